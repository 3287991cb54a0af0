"""GPU facts the cost model needs, looked up by the name a trace's ``env`` records.

The simulator and the features take a :class:`GpuSpec`, never a GPU name, so one code
path serves any GPU: add its row to :data:`KNOWN_GPUS` (or build a spec by hand) and the
same model code runs for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from fasttree.validation import check_number, is_int

__all__ = ["KNOWN_GPUS", "GpuSpec", "gpu_spec"]


@dataclass(frozen=True)
class GpuSpec:
    """What the analytic simulator knows about a GPU.

    Attributes
    ----------
    name : str
        ``torch.cuda.get_device_name()`` of the GPU, as traces record it.
    sm_count : int
        Streaming multiprocessors.
    hbm_bytes_per_s : float
        DRAM bandwidth the roofline uses (bytes per second).
    tensor_flops : float
        Dense fp16/bf16 tensor-core rate the roofline uses (flop per second).
    smem_per_sm : int
        Shared memory one SM can give its resident programs (bytes).
    max_warps_per_sm : int
        Resident warps per SM.
    max_programs_per_sm : int
        Resident thread blocks per SM.
    """

    name: str
    sm_count: int
    hbm_bytes_per_s: float
    tensor_flops: float
    smem_per_sm: int = 227 * 1024
    max_warps_per_sm: int = 64
    max_programs_per_sm: int = 32

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuSpec:
        """Inverse of :meth:`to_dict`; unknown keys are a ``ValueError``."""
        if not isinstance(d, dict):
            raise ValueError(f"a GPU spec must be a dict, got {type(d).__name__}")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown GPU spec fields {sorted(unknown)}")
        spec = cls(**d)
        for field in ("sm_count", "hbm_bytes_per_s", "tensor_flops", "smem_per_sm", "max_warps_per_sm"):
            value = getattr(spec, field)
            check_number(f"GPU spec {field}", value, above=0, finite=False, expected="a positive number")
        return spec


#: The roofline numbers of the project's H200 anchors (4.8 TB/s, 700 TFLOP/s), and the H100 SXM's.
KNOWN_GPUS: dict[str, GpuSpec] = {
    "NVIDIA H200": GpuSpec(name="NVIDIA H200", sm_count=132, hbm_bytes_per_s=4.8e12, tensor_flops=700e12),
    "NVIDIA H100 80GB HBM3": GpuSpec(
        name="NVIDIA H100 80GB HBM3", sm_count=132, hbm_bytes_per_s=3.35e12, tensor_flops=700e12
    ),
}


def gpu_spec(env_or_name: dict[str, Any] | str) -> GpuSpec:
    """The :class:`GpuSpec` of a trace ``env`` (or a GPU name).

    The SM count of ``env["gpu_sm_count"]``, when present, overrides the table's (a GPU
    with fewer SMs enabled, or MIG).

    Raises
    ------
    ValueError
        When the GPU is not in :data:`KNOWN_GPUS`.
    """
    env = {"gpu_name": env_or_name} if isinstance(env_or_name, str) else env_or_name
    name = env.get("gpu_name")
    spec = KNOWN_GPUS.get(str(name))
    if spec is None:
        raise ValueError(
            f"no GPU facts for {name!r}; known: {sorted(KNOWN_GPUS)} "
            "(add a GpuSpec to fasttree.costmodel.gpu.KNOWN_GPUS)"
        )
    sms = env.get("gpu_sm_count")
    if is_int(sms) and sms > 0 and sms != spec.sm_count:
        spec = replace(spec, sm_count=int(sms))
    return spec
