"""bench.variant_ids: the counts of a short run add up and the reports are written (CPU)."""

from __future__ import annotations

import json

from bench import variant_ids


def test_short_run_counts_add_up_and_writes_both_reports(tmp_path, capsys):
    assert variant_ids.main(["--steps", "24", "--max-variants", "2", "--scenarios", "few_shot",
                             "--out", str(tmp_path), "--label", "t"]) == 0  # fmt: skip
    data = json.loads((tmp_path / "variant_ids_t.json").read_text())
    assert data["max_variants"] == 2 and len(data["rows"]) == len(variant_ids.HEADS)
    for row in data["rows"]:
        assert row["steps"] == 24 and row["fixed_share"] == 0.0  # with live ids, no step runs the fixed launch
        assert row["distinct_variants"] > 2  # so some step was covered or got a new id in place of an old one
        assert row["covered_share"] > 0 or row["ids_handed_out"] > 2
        if row["covered_share"]:
            assert row["covered_programs_mean"] >= 1.0
        assert row["variant_us"] > 0 and row["table_us"] > 0  # host time a step, both measured
    assert "| few_shot | 32/32 | 24 |" in (tmp_path / "variant_ids_t.md").read_text()
    assert "ids handed out" in capsys.readouterr().out


def test_max_variants_zero_runs_every_step_with_the_fixed_launch(tmp_path):
    variant_ids.main(["--steps", "6", "--max-variants", "0", "--scenarios", "chain_reasoning", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "variant_ids_cpu.json").read_text())["rows"]
    assert all(r["fixed_share"] == 1.0 and r["ids_handed_out"] == 0 for r in rows)
