"""kvray kernels: Triton paged attention and cache writes, with torch references beside them.

Kernels read the KV cache only through the strides of kvcore's per-layer views, so every one of
the six layouts runs through the same code. Never imports ray.
"""
