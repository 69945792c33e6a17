"""Attention and other hot-path kernels: a plain-torch reference for each, Triton on GPU."""
