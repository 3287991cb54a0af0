"""fasttree: tree-structured decode attention (FastTree) with a fast planner and Triton kernels.

Quick use::

    import fasttree as ft
    tree = ft.KVTree.from_levels([1, 2, 64], [8, 256, 32])
    plan = ft.plan(tree, ft.FastTreeConfig(), num_q_heads=32, num_kv_heads=8, head_dim=128)
    o = ft.tree_attention(q, k_cache, v_cache, plan)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter import tree_from_radix_nodes, tree_from_req_to_token, tree_from_token_slots
    from .attention import query_separated_attention, tree_attention
    from .config import FastTreeConfig
    from .export import ConfigExport, ExportEntry, ExportGuard, load_portfolio, read_export, write_export
    from .groups import Groups
    from .plan_arrays import DevicePlan, Plan
    from .plan_extend import PlanExtender
    from .plan_rules import PlanRules
    from .planner import build_groups, greedy_edge_assignment, plan
    from .portfolio import LeafRegion, Portfolio, Selector, tree_features
    from .query_separated import plan_query_separated
    from .recording import WorkloadRecorder
    from .reference import max_relative_error, reference_attention
    from .runtime import RuntimePlan, TreeAttentionRuntime
    from .tree import KVTree

#: Where each public name lives: loaded on first access (PEP 562), so ``import fasttree`` (and
#: ``fasttree-tune --version``) does not import torch and Triton until a name that needs them is used.
_LAZY = {
    "tree_from_radix_nodes": "adapter",
    "tree_from_req_to_token": "adapter",
    "tree_from_token_slots": "adapter",
    "plan_query_separated": "query_separated",
    "query_separated_attention": "attention",
    "tree_attention": "attention",
    "FastTreeConfig": "config",
    "ConfigExport": "export",
    "ExportEntry": "export",
    "ExportGuard": "export",
    "load_portfolio": "export",
    "read_export": "export",
    "write_export": "export",
    "Groups": "groups",
    "DevicePlan": "plan_arrays",
    "Plan": "plan_arrays",
    "PlanExtender": "plan_extend",
    "PlanRules": "plan_rules",
    "build_groups": "planner",
    "greedy_edge_assignment": "planner",
    "plan": "planner",
    "LeafRegion": "portfolio",
    "Portfolio": "portfolio",
    "Selector": "portfolio",
    "tree_features": "portfolio",
    "WorkloadRecorder": "recording",
    "max_relative_error": "reference",
    "reference_attention": "reference",
    "RuntimePlan": "runtime",
    "TreeAttentionRuntime": "runtime",
    "KVTree": "tree",
}

__version__ = "0.1.0"

__all__ = [
    "ConfigExport",
    "DevicePlan",
    "ExportEntry",
    "ExportGuard",
    "FastTreeConfig",
    "Groups",
    "KVTree",
    "LeafRegion",
    "Plan",
    "PlanExtender",
    "PlanRules",
    "Portfolio",
    "RuntimePlan",
    "Selector",
    "TreeAttentionRuntime",
    "WorkloadRecorder",
    "build_groups",
    "greedy_edge_assignment",
    "load_portfolio",
    "max_relative_error",
    "plan",
    "plan_query_separated",
    "query_separated_attention",
    "read_export",
    "reference_attention",
    "tree_attention",
    "tree_features",
    "tree_from_radix_nodes",
    "tree_from_req_to_token",
    "tree_from_token_slots",
    "write_export",
]


def __getattr__(name: str) -> Any:
    """Load a public name from its submodule on first access (and keep it)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fasttree' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
