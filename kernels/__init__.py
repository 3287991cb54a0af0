"""Triton kernels of fasttree (installed as ``fasttree.kernels``): ``@triton.jit`` code only.

Host wrappers that validate inputs, allocate outputs, size grids and launch these
kernels live in :mod:`fasttree.attention`.
"""

from .tree_attention import tree_attention_kernel

__all__ = ["tree_attention_kernel"]
