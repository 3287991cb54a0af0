"""Triton kernels of fasttree (installed as ``fasttree.kernels``): ``@triton.jit`` code only.

Host wrappers that validate inputs, allocate outputs, size grids and launch these
kernels live in :mod:`fasttree.attention` and :mod:`fasttree.runtime`.
"""

from .merge import (
    merge_many_partials_kernel,
    merge_partials_kernel,
    merge_partials_persistent_kernel,
)
from .tree_attention import (
    relocate_plan_kernel,
    tree_attention_persistent_kernel,
    tree_attention_units_kernel,
)

__all__ = [
    "merge_many_partials_kernel",
    "merge_partials_kernel",
    "merge_partials_persistent_kernel",
    "relocate_plan_kernel",
    "tree_attention_persistent_kernel",
    "tree_attention_units_kernel",
]
