"""What a tuned export is valid for: the kernel version and a fingerprint of today's defaults.

Standard library and the package's light modules only: export files are checked against these on
the serving path without importing torch.
"""

from __future__ import annotations

import hashlib
import json

from .config import FastTreeConfig
from .plan_rules import PlanRules, deciding_fields

__all__ = ["KERNEL_VERSION", "defaults_fingerprint"]

#: Version of the tree-attention kernels and their launch choices (:mod:`fasttree.launch_rules`).
#: Bump it when a change moves the GPU time of an unchanged plan (a planner-only change does not),
#: and add its line to the version table of ``docs/history.md``. The profiler writes it into every
#: trace (``meta.profiler.kernel_version``), the latency model takes it as a feature, and a tuned
#: export's entries record it: an entry tuned for other kernels falls back to the defaults.
KERNEL_VERSION = 35


def defaults_fingerprint() -> str:
    """A short SHA-256 of what "the defaults" mean today: ``FastTreeConfig()`` and the planning
    rules of ``ft.plan`` and of the runtime (less the rules still at the value they were added
    with: :func:`fasttree.plan_rules.deciding_fields`). A tuned export records it: an entry tuned
    against other defaults (whose gains were measured against another baseline) falls back to them."""
    state = {
        "config": FastTreeConfig().to_dict(),
        "rules": deciding_fields(PlanRules.defaults()),
        "runtime_rules": [deciding_fields(PlanRules.runtime(n)) for n in (1, 2)],
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
