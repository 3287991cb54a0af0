"""bench.costmodel_decode_check (CPU): the committed GPU sweeps match the regenerated configs and the
report is rebuilt from them with metrics that react to the predictions."""

from __future__ import annotations

import numpy as np
import pytest

from bench import costmodel_decode_check as check


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
