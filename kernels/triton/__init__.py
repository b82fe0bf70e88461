"""Triton kernels of the CUDA paths, loaded by file path by raylib.ops (importing this package
does not import triton)."""
