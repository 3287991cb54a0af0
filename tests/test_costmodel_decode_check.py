"""bench.costmodel_decode_check (CPU): the committed GPU sweeps match the regenerated configs and the
report is rebuilt from them with metrics that react to the predictions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench import costmodel_decode_check as check
from fasttree import ConfigExport, ExportEntry, ExportGuard, FastTreeConfig, Portfolio, Selector, read_export


def test_rank_metrics_follow_the_scores():
    meas = np.array([100.0, 90.0, 120.0, 80.0])
    right = check.rank_metrics(meas * 1.1, meas)
    assert right["tau"] == pytest.approx(1.0) and right["pairs_ok"] == 1.0
    assert right["pick"] == 3 and right["top1"] == 1.0 and right["pick_vs_tuned"] == pytest.approx(0.8)
    wrong = check.rank_metrics(-meas, meas)
    assert wrong["tau"] == pytest.approx(-1.0) and wrong["pairs_ok"] == 0.0
    assert wrong["pick"] == 2 and wrong["top1"] == pytest.approx(80 / 120)


def test_report_is_rebuilt_from_the_committed_sweeps(tmp_path):
    out = tmp_path / "check.md"
    assert check.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert "## Findings" in text and "decode_config_sweep2_f18595e.json" in text
    assert text.count("| learned |") == 8  # 2 sweeps x 2 models x 2 scenarios


def test_the_sweeps_base_config_is_the_exports_runtime_config():
    v1 = read_export("traces/decode_sweeps/export_f18595e.json")  # the export the sweeps varied (format 1)
    (entry,) = [e for e in v1.entries if e.bucket == (4, 128, "float16")]
    assert check.sweep_base_config(v1, 32, 8) == entry.portfolio.members[0]
    tuned = FastTreeConfig(kv_split_sizes=(512, 64))
    runtime = ExportEntry(
        gpu=check.GPU, group_size=4, head_dim=128, dtype="float16",
        portfolio=Portfolio(members=(FastTreeConfig(), tuned), selector=Selector(member=(1,)), runtime=True),
        provenance={}, target="runtime", guard=ExportGuard.current(),
    )  # fmt: skip
    v2 = ConfigExport(entries=(runtime,), provenance={})
    assert check.sweep_base_config(v2, 32, 8) == tuned
    with pytest.raises(ValueError, match="no runtime entry"):
        check.sweep_base_config(v2, 32, 32)  # no entry: not the defaults in its place
    only_kernels = ConfigExport(entries=(dataclasses.replace(runtime, target="tree_attention",
                                        portfolio=dataclasses.replace(runtime.portfolio, runtime=False)),),
                                provenance={})  # fmt: skip
    with pytest.raises(ValueError, match="no runtime entry"):
        check.sweep_base_config(only_kernels, 32, 8)
