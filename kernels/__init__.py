"""Triton kernels of fasttree (installed as ``fasttree.kernels``): ``@triton.jit`` code only, and
one ``@gluon.jit`` kernel for sm_90 (``tree_attention_units_sm90_kernel``; None where the installed
Triton has no Gluon for Hopper, and then never launched).

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

try:  # Gluon's Hopper ops (Triton 3.5+): the sm_90 stage 1 is optional, the Triton kernel the fallback
    from .tree_attention_sm90 import tree_attention_units_sm90_kernel
except (ImportError, AttributeError):  # pragma: no cover - a Triton without Gluon for Hopper
    tree_attention_units_sm90_kernel = None

__all__ = [
    "merge_many_partials_kernel",
    "merge_partials_kernel",
    "merge_partials_persistent_kernel",
    "relocate_plan_kernel",
    "tree_attention_persistent_kernel",
    "tree_attention_units_kernel",
    "tree_attention_units_sm90_kernel",
]
