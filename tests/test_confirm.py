"""``fasttree.toolkit.confirm`` and ``fasttree-tune confirm``: selector leaves relabelled from measured
cases, each confirmed leaf fenced by the region of its measured trees, by hand, through the command
line and back through the export's lookup."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from fasttree import FastTreeConfig, KVTree, LeafRegion, Portfolio, Selector, load_portfolio, tree_features
from fasttree.cli import main
from fasttree.cli.tune import RUN_HELDOUT
from fasttree.export import ConfigExport, ExportEntry, ExportGuard, read_export
from fasttree.portfolio import TREE_FEATURES
from fasttree.toolkit.confirm import ConfirmRules, case_trees, confirm_export, confirm_portfolio
from fasttree.toolkit.validate import CaseValidation
from fasttree.toolkit.workload_split import case_name
from fasttree.traces import decode_tree, read_traces

A = FastTreeConfig(alpha=0.4)
B = FastTreeConfig(pack_tokens=0)
#: Root splits on feature 0; node 1 (left) is a leaf naming A, node 2 splits again into leaves 3 (B)
#: and 4 (the defaults).
SELECTOR = Selector(feature=(0, -1, 1, -1, -1), threshold=(1.0, 0, 2.0, 0, 0), left=(1, -1, 3, -1, -1),
                    right=(2, -1, 4, -1, -1), member=(0, 1, 0, 2, 0))  # fmt: skip
N_FEATURES = len(TREE_FEATURES)


def _predicted(selector: Selector, layouts) -> tuple:
    """The model's regions: a wide box at ``layouts`` on every leaf naming a tuned member."""
    wide = LeafRegion((-1e6,) * N_FEATURES, (1e6,) * N_FEATURES, layouts, trees=20, evidence="predicted")
    return tuple(wide if f < 0 and m else None for f, m in zip(selector.feature, selector.member, strict=True))


PORTFOLIO = Portfolio((FastTreeConfig(), A, B), SELECTOR, regions=_predicted(SELECTOR, ((8, 4),)))
BUCKET = "g4-d128-float16"


def cases(leaf: int, times: list[list[float]], target: str = "tree_attention", bucket: str = BUCKET, heads=(32, 8)):
    """Measured cases of ``leaf``: tree i has features (i, 10 + i, 0.5, ...) and ``heads``."""
    return [
        CaseValidation(
            "f",
            f"f/x/seed0/step{i} {heads[0]}/{heads[1]}",
            bucket,
            target,
            SELECTOR.member[leaf],
            list(us),
            leaf=leaf,
            features=[float(i), 10.0 + i] + [0.5] * (N_FEATURES - 2),
            heads=list(heads),
        )
        for i, us in enumerate(times)
    ]


def test_a_leaf_keeps_a_member_measured_faster_on_every_tree():
    measured = cases(1, [[100, 90, 100]] * 5) + cases(3, [[100, 100, 100]] * 5) + cases(4, [[100, 100, 100]] * 5)
    confirmed, decisions = confirm_portfolio(PORTFOLIO, measured, target="tree_attention", bucket=BUCKET)
    assert [(d.leaf, d.trees, d.predicted, d.confirmed) for d in decisions] == [
        (1, 5, 1, 1),
        (3, 5, 2, 0),
        (4, 5, 0, 0),
    ]
    assert decisions[0].ratios == pytest.approx((1.0, 0.9, 1.0)) and decisions[0].worst == pytest.approx(
        (1, 100 / 90, 1)
    )
    # B is named by no leaf any more: dropped, the selector renumbered
    assert confirmed.members == (FastTreeConfig(), A)
    assert confirmed.selector.member == (0, 1, 0, 0, 0)
    assert confirmed.selector.feature == SELECTOR.feature and confirmed.selector.threshold == SELECTOR.threshold
    # the confirmed leaf is fenced by its five measured trees (the model's wide region is gone), the rest by none
    region = confirmed.regions[1]
    assert (region.evidence, region.trees, region.layouts) == ("measured", 5, ((8, 4),))
    assert region.lo[:2] == (0.0, 10.0) and region.hi[:2] == (4.0, 14.0) and region.lo[2:] == region.hi[2:]
    assert [r is None for r in confirmed.regions] == [True, False, True, True, True]


def test_one_slow_tree_small_gains_and_few_trees_keep_the_defaults():
    slow_tree = [[100, 85, 100]] * 4 + [[100, 104, 100]]  # 1/1.04 = 0.96x on one tree: below the floor
    small_gain = [[100, 100, 98]] * 5  # 2% faster: under the 3% gain
    few = [[100, 100, 50]] * 3  # 3 trees: under min_trees
    measured = cases(1, slow_tree) + cases(3, small_gain) + cases(4, few)
    confirmed, decisions = confirm_portfolio(PORTFOLIO, measured)
    assert [d.confirmed for d in decisions] == [0, 0, 0]
    assert confirmed.members == (FastTreeConfig(),) and confirmed.selector == Selector()
    # looser rules accept the same measurements
    loose = ConfirmRules(min_trees=3, min_gain=0.01, tree_floor=0.95)
    _, decisions = confirm_portfolio(PORTFOLIO, measured, loose)
    assert [d.confirmed for d in decisions] == [1, 2, 2]


def test_a_leaf_the_model_left_at_the_defaults_gets_the_fastest_member_that_passes():
    measured = cases(4, [[100, 95, 90]] * 6) + cases(3, [[100, 80, 90]] * 4)
    confirmed, decisions = confirm_portfolio(PORTFOLIO, measured)
    by_leaf = {d.leaf: d for d in decisions}
    assert (by_leaf[4].predicted, by_leaf[4].confirmed) == (0, 2)  # B: 0.90 beats A: 0.95
    assert (by_leaf[3].predicted, by_leaf[3].confirmed) == (2, 1)  # A measured faster than the model's B
    assert by_leaf[1].trees == 0 and by_leaf[1].confirmed == 0  # no measured tree: the defaults
    assert confirmed.members == (FastTreeConfig(), A, B) and confirmed.selector.member == (0, 0, 0, 1, 2)
    assert (confirmed.regions[3].trees, confirmed.regions[4].trees) == (4, 6)  # each leaf its own trees


def test_a_leaf_measured_at_two_kv_heads_serves_the_defaults_at_one_and_outside_its_box():
    """The measured failure: a leaf confirmed on GQA-16 trees at 2 KV heads and shorter documents served a
    tree of two 30k-token documents at 1 KV head. Confirmed now, it gives that tree the defaults."""
    short = [KVTree.from_levels((2, 16), (n, 40)) for n in (2000, 3000, 4000, 6000, 8000)]
    measured = [
        CaseValidation(
            "long_documents",
            f"docs/seed0/step{i} 32/2",
            "g16-d128-float16",
            "tree_attention",
            1,
            [30.0, 27.0],
            leaf=0,
            features=tree_features(t).tolist(),
            heads=[32, 2],
        )
        for i, t in enumerate(short)
    ]
    portfolio = Portfolio(
        (FastTreeConfig(), A), Selector(member=(1,)), regions=_predicted(Selector(member=(1,)), ((2, 16),))
    )
    confirmed, (decision,) = confirm_portfolio(portfolio, measured)
    assert decision.confirmed == 1 and confirmed.regions[0].layouts == ((2, 16),)
    long_docs = KVTree.from_levels((2, 16), (30000, 40))  # two 30k-token documents, 8 questions each
    inside = KVTree.from_levels((2, 16), (5000, 40))
    at_two, at_one = confirmed.for_heads(32, 2), confirmed.for_heads(16, 1)
    assert at_two.select(inside) == A and at_two.select(short[0]) == A
    assert at_one.select(inside) == FastTreeConfig() and at_one.select(short[0]) == FastTreeConfig()
    assert at_two.select(long_docs) == FastTreeConfig()  # longer documents than any measured tree
    assert portfolio.for_heads(32, 2).select(long_docs) == A  # the model's region would have served it


def test_a_confirmed_leaf_needs_the_features_of_its_trees():
    measured = cases(1, [[100, 90, 100]] * 5)
    measured[2].features = None
    with pytest.raises(ValueError, match=r"f/x/seed0/step2 32/8: the measurement records no tree features"):
        confirm_portfolio(PORTFOLIO, measured)
    measured = cases(1, [[100, 100, 100]] * 5)  # a leaf that stays at the defaults needs none
    measured[2].features = None
    confirm_portfolio(PORTFOLIO, measured)


def test_mismatched_measurements_are_refused():
    with pytest.raises(ValueError, match="2 members measured, the portfolio has 3"):
        confirm_portfolio(PORTFOLIO, [CaseValidation("f", "c", BUCKET, "tree_attention", 0, [1.0, 1.0], leaf=1)])
    with pytest.raises(ValueError, match="leaf 2 is not a leaf"):
        confirm_portfolio(PORTFOLIO, [CaseValidation("f", "c", BUCKET, "tree_attention", 0, [1.0] * 3, leaf=2)])
    with pytest.raises(ValueError, match="tree_floor"):
        ConfirmRules(tree_floor=1.5)


def _export(gpu: str = "NVIDIA H200") -> ConfigExport:
    common = {"gpu": gpu, "head_dim": 128, "dtype": "float16", "guard": ExportGuard.current(),
              "provenance": {"n_trials": 3}}  # fmt: skip
    one_leaf = Selector(member=(1,))
    return ConfigExport(
        entries=(
            ExportEntry(**common, group_size=4, portfolio=PORTFOLIO, target="tree_attention"),
            ExportEntry(
                **common,
                group_size=1,
                portfolio=Portfolio((FastTreeConfig(), A), one_leaf, regions=_predicted(one_leaf, ((32, 1),))),
                target="tree_attention",
            ),
            ExportEntry(**common, group_size=4, portfolio=Portfolio(runtime=True), target="runtime"),
        ),
        provenance={},
    )


def test_confirm_export_changes_only_the_measured_gpus_multi_member_entries():
    measured = cases(1, [[100, 90, 100]] * 5)
    confirmed, decisions = confirm_export(_export(), measured, gpu="NVIDIA H200", source="v.json", export_sha256="ab")
    entries = {(e.group_size, e.target): e for e in confirmed.entries}
    assert entries[(4, "tree_attention")].portfolio.members == (FastTreeConfig(), A)
    assert entries[(4, "tree_attention")].provenance["confirmed"] == {
        "source": "v.json", "export_sha256": "ab", "trees": 5,
        "rules": {"min_trees": 4, "min_gain": 0.03, "tree_floor": 0.97},
        "leaves_changed": 1, "members_before": 3,
    }  # fmt: skip
    assert entries[(4, "tree_attention")].provenance["n_trials"] == 3
    # g1 had no measured tree: its one leaf goes back to the defaults
    assert entries[(1, "tree_attention")].portfolio.members == (FastTreeConfig(),)
    runtime = entries[(4, "runtime")]  # one member: nothing to confirm, untouched
    assert runtime.portfolio == Portfolio(runtime=True) and "confirmed" not in runtime.provenance
    assert {(d.bucket, d.leaf) for d in decisions} == {(BUCKET, 1), (BUCKET, 3), (BUCKET, 4), ("g1-d128-float16", 0)}
    assert ConfigExport.from_dict(confirmed.to_dict()) == confirmed  # a valid export
    # another GPU's measurements change nothing
    same, decisions = confirm_export(_export(), measured, gpu="NVIDIA H100")
    assert same == _export() and decisions == []


def _measured_file(tmp_path, export_path, cases_, gpu="NVIDIA H200"):
    doc = {"gpu": gpu, "export": str(export_path),
           "export_sha256": hashlib.sha256(export_path.read_bytes()).hexdigest(),
           "cases": [dict(vars(c), speedup=c.speedup) for c in cases_]}  # fmt: skip
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(doc))
    return path


def test_confirm_cli_writes_the_confirmed_export_and_the_leaf_table(tmp_path, capsys):
    export_path = tmp_path / "export.json"
    export_path.write_text(json.dumps(_export().to_dict()))
    measured = _measured_file(tmp_path, export_path, cases(1, [[100, 90, 100]] * 5) + cases(4, [[100, 99, 80]] * 4))
    out, md = tmp_path / "confirmed.json", tmp_path / "leaves.md"
    assert main(["confirm", "--config", str(export_path), "--measured", str(measured), "-o", str(out),
                 "--markdown", str(md)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "| tree_attention | g4-d128-float16 | 4 | 4 | 0 | 2 | 1.000, 0.990, 0.800 | 1.000, 1.010, 1.250 |" in text
    assert md.read_text().startswith("Selector leaves of")
    entry = {(e.group_size, e.target): e for e in read_export(out).entries}[(4, "tree_attention")]
    assert entry.portfolio.members == (FastTreeConfig(), A, B) and entry.portfolio.selector.member == (0, 1, 0, 0, 2)
    assert [r.trees for r in entry.portfolio.regions if r is not None] == [5, 4]
    assert entry.provenance["confirmed"]["export_sha256"] == hashlib.sha256(export_path.read_bytes()).hexdigest()
    # an existing output is replaced only with --overwrite
    with pytest.raises(SystemExit) as exc:
        main(["confirm", "--config", str(export_path), "--measured", str(measured), "-o", str(out)])
    assert exc.value.code == 2 and "--overwrite" in capsys.readouterr().err


def test_confirm_cli_refuses_measurements_of_another_export_or_malformed_ones(tmp_path, capsys):
    export_path = tmp_path / "export.json"
    export_path.write_text(json.dumps(_export().to_dict()))
    measured = _measured_file(tmp_path, export_path, cases(1, [[100, 90, 100]] * 5))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_export("NVIDIA H100").to_dict()))
    for config, doc, message in [
        (other, measured, "measured another export"),
        (export_path, None, "not a 'fasttree-tune validate --json' file"),
        (export_path, "bad", "case 0 is malformed"),
        (export_path, "old", "no export_sha256"),
    ]:
        if doc is None:
            doc = tmp_path / "list.json"
            doc.write_text("[]")
        elif doc == "old":
            data = json.loads(measured.read_text())
            del data["export_sha256"]
            doc = tmp_path / "old.json"
            doc.write_text(json.dumps(data))
        elif doc == "bad":
            data = json.loads(measured.read_text())
            data["cases"][0]["member_us"] = [100, -1, 100]
            doc = tmp_path / "bad.json"
            doc.write_text(json.dumps(data))
        with pytest.raises(SystemExit) as exc:
            main(["confirm", "--config", str(config), "--measured", str(doc), "-o", str(tmp_path / "o.json")])
        assert exc.value.code == 2 and message in capsys.readouterr().err
        assert not (tmp_path / "o.json").exists()


def _heldout_cases(n: int = 6) -> list[CaseValidation]:
    """Cases named after the first ``n`` steps of a shipped held-out workload, as an older validate wrote them
    (no features, no heads), each measured 10% faster with member 1."""
    records = read_traces([f"{RUN_HELDOUT}/few_shot_gqa16_7b.jsonl.gz"], kind="workload").records[:n]
    return [
        CaseValidation("serving/few_shot", case_name(r), "g16-d128-float16", "tree_attention", 1, [10.0, 9.0], leaf=0)
        for r in records
    ]


def test_case_trees_finds_the_trees_of_an_older_validate_by_name():
    measured = _heldout_cases()
    measured.append(
        CaseValidation("f", "nowhere/x/seed0/step0 32/2", "g16-d128-float16", "tree_attention", 0, [1.0, 1.0])
    )
    assert case_trees(measured, [RUN_HELDOUT]) == 6
    records = read_traces([f"{RUN_HELDOUT}/few_shot_gqa16_7b.jsonl.gz"], kind="workload").records[:6]
    for c, r in zip(measured, records, strict=False):
        assert c.heads == [32, 2]
        np.testing.assert_array_equal(c.features, tree_features(decode_tree(r["workload"]["tree"])))
    assert measured[-1].features is None and measured[-1].heads is None  # no such tree: left as it was
    assert case_trees(measured[:6], [RUN_HELDOUT]) == 0  # nothing left to find


def test_confirm_cli_fences_leaves_measured_by_an_older_validate(tmp_path):
    one_leaf = Selector(member=(1,))
    entry = ExportEntry(
        gpu="NVIDIA H200", group_size=16, head_dim=128, dtype="float16", target="tree_attention",
        portfolio=Portfolio((FastTreeConfig(), A), one_leaf, regions=_predicted(one_leaf, ((2, 16), (1, 16)))),
        provenance={}, guard=ExportGuard.current(),
    )  # fmt: skip
    export_path = tmp_path / "export.json"
    export_path.write_text(json.dumps(ConfigExport((entry,), {}).to_dict()))
    measured = _measured_file(tmp_path, export_path, _heldout_cases())
    doc = json.loads(measured.read_text())
    for c in doc["cases"]:
        del c["features"], c["heads"]
    measured.write_text(json.dumps(doc))
    out = tmp_path / "confirmed.json"
    assert main(["confirm", "--config", str(export_path), "--measured", str(measured), "-o", str(out)]) == 0
    (region,) = read_export(out).entries[0].portfolio.regions
    assert (region.trees, region.layouts, region.evidence) == (6, ((2, 16),), "measured")
    shape = {"gpu": "NVIDIA H200", "head_dim": 128, "dtype": "float16"}
    records = read_traces([f"{RUN_HELDOUT}/few_shot_gqa16_7b.jsonl.gz"], kind="workload").records[:6]
    tree = decode_tree(records[3]["workload"]["tree"])
    assert load_portfolio(out, **shape, num_q_heads=32, num_kv_heads=2).select(tree) == A
    # the model's region listed 1 KV head too; the measurements did not: the defaults there now
    assert load_portfolio(out, **shape, num_q_heads=16, num_kv_heads=1).select(tree) == FastTreeConfig()
    assert load_portfolio(export_path, **shape, num_q_heads=16, num_kv_heads=1).select(tree) == A


def test_confirm_cli_refuses_a_confirmed_leaf_whose_trees_it_cannot_find(tmp_path, capsys):
    one_leaf = Selector(member=(1,))
    entry = ExportEntry(
        gpu="NVIDIA H200", group_size=4, head_dim=128, dtype="float16", target="tree_attention",
        portfolio=Portfolio((FastTreeConfig(), A), one_leaf, regions=_predicted(one_leaf, ((8, 4),))),
        provenance={}, guard=ExportGuard.current(),
    )  # fmt: skip
    export_path = tmp_path / "export.json"
    export_path.write_text(json.dumps(ConfigExport((entry,), {}).to_dict()))
    measured = cases(0, [[100, 90]] * 5)
    for c in measured:
        c.features = c.heads = None
    path = _measured_file(tmp_path, export_path, measured)
    with pytest.raises(SystemExit) as exc:
        main(["confirm", "--config", str(export_path), "--measured", str(path), "-o", str(tmp_path / "o.json")])
    assert exc.value.code == 2 and "measure it again" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
