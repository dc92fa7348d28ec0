"""Weights kept in GGUF's integer blocks and the matrix products that read them."""
