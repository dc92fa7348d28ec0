"""Whole decoder layers as C kernels for small-batch decode on CPUs."""
