"""Latency-model metrics: per-measurement errors, per-tree ranking (Kendall tau-b, top-k), the markdown table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fasttree.costmodel.metrics import (
    RankMetrics,
    absolute_percentage_errors,
    evaluation_table,
    per_tree_rank_metrics,
    regression_metrics,
)

# --- absolute_percentage_errors / regression_metrics -------------------------------------------------------------


def test_ape_exact_values():
    ape = absolute_percentage_errors([11.0, 18.0, 10.0, 0.0], [10.0, 20.0, 10.0, 5.0])
    assert ape.dtype == np.float64
    np.testing.assert_allclose(ape, [0.1, 0.1, 0.0, 1.0])


def test_regression_metrics_exact_values():
    # meas all 10; pred off by 0, 1, 2, ..., 10 us -> ape 0.0, 0.1, ..., 1.0 (11 values)
    meas = np.full(11, 10.0)
    pred = meas + np.arange(11.0)
    m = regression_metrics(pred, meas)
    assert m["n"] == 11
    assert m["mape"] == pytest.approx(0.5)
    assert m["median_ape"] == pytest.approx(0.5)
    assert m["p90_ape"] == pytest.approx(0.9)  # 90th percentile of 0..1 in steps of 0.1, linear interpolation
    assert m["max_ape"] == pytest.approx(1.0)
    expected_log_rmse = math.sqrt(np.mean(np.log1p(np.arange(11.0) / 10) ** 2))
    assert m["log_rmse"] == pytest.approx(expected_log_rmse)


def test_regression_p90_interpolates():
    # ape 0, 0.1, 0.2, 0.3: position 0.9 * 3 = 2.7 -> 0.2 + 0.7 * 0.1 = 0.27
    m = regression_metrics([10.0, 11.0, 12.0, 13.0], [10.0] * 4)
    assert m["p90_ape"] == pytest.approx(0.27)
    assert m["median_ape"] == pytest.approx(0.15)


def test_regression_log_rmse_symmetric():
    # over- and under-prediction by the same factor have the same log error
    m = regression_metrics([20.0, 5.0], [10.0, 10.0])
    assert m["log_rmse"] == pytest.approx(math.log(2))
    assert m["mape"] == pytest.approx((1.0 + 0.5) / 2)


@pytest.mark.parametrize(
    ("pred", "meas", "match"),
    [
        ([1.0, 2.0], [1.0, 2.0, 3.0], "same shape"),
        ([[1.0, 2.0]], [[1.0, 2.0]], "pred_us must be 1-D"),
        ([1.0, 2.0], [[1.0, 2.0]], "meas_us must be 1-D"),
        ([], [], "empty"),
        ([1.0, np.nan], [1.0, 2.0], "pred_us must be finite"),
        ([1.0, 2.0], [1.0, np.inf], "meas_us must be finite"),
        ([1.0, 2.0], [1.0, 0.0], "meas_us must be > 0"),
        ([1.0, 2.0], [-1.0, 2.0], "meas_us must be > 0"),
        ([1.0, -0.5], [1.0, 2.0], "pred_us must be >= 0"),
        (["a", "b"], [1.0, 2.0], "pred_us must be an array of numbers"),
        ([1.0, 2.0], [None, 2.0], "meas_us must be"),
    ],
)
def test_ape_and_regression_reject_bad_input(pred, meas, match):
    with pytest.raises(ValueError, match=match):
        absolute_percentage_errors(pred, meas)
    with pytest.raises(ValueError, match=match):
        regression_metrics(pred, meas)


def test_regression_rejects_zero_prediction():
    assert absolute_percentage_errors([0.0, 1.0], [1.0, 1.0])[0] == 1.0  # fine for the APE ...
    with pytest.raises(ValueError, match=r"pred_us must be > 0 for log_rmse"):
        regression_metrics([0.0, 1.0], [1.0, 1.0])  # ... but not for ln(pred)


# --- per_tree_rank_metrics: hand-computed examples -------------------------------------------------------------------


def test_rank_two_trees_by_hand():
    # tree "a": meas 10, 20, 30; pred 12, 25, 20
    #   pairs (0,1): pred <, meas < concordant; (0,2): <, < concordant; (1,2): pred >, meas < discordant
    #   tau = (2 - 1) / 3 = 1/3; top-1 pick = config 0 (pred 12) -> 10 = best; top-5 (capped at 3) -> 10
    # tree "b": meas 40, 50, 60; pred 70, 60, 50 (reversed) -> tau = -1
    #   top-1 pick = config 2 (pred 50) -> 60, best 40; top-5 -> 40
    # tree "c": one measurement, ignored
    # top1_score = (10 + 40) / (10 + 60) = 5/7; a_peak@1 = (10/10 + 40/60) / 2 = 5/6; top-5 both 1
    # mean tau = median tau = (1/3 - 1) / 2 = -1/3
    tree = ["b", "a", "c", "a", "b", "a", "b"]  # interleaved on purpose
    meas = [40.0, 10.0, 7.0, 20.0, 50.0, 30.0, 60.0]
    pred = [70.0, 12.0, 1.0, 25.0, 60.0, 20.0, 50.0]
    r = per_tree_rank_metrics(pred, meas, tree)
    assert isinstance(r, RankMetrics)
    assert r.n_trees == 2
    assert r.n_trees_tau_undefined == 0
    assert r.mean_kendall_tau == pytest.approx(-1 / 3)
    assert r.median_kendall_tau == pytest.approx(-1 / 3)
    assert r.top_k_score == {1: pytest.approx(5 / 7), 5: pytest.approx(1.0)}
    assert r.a_peak_at_k == {1: pytest.approx(5 / 6), 5: pytest.approx(1.0)}
    assert [t["tree"] for t in r.per_tree] == ["a", "b"]
    a, b = r.per_tree
    assert a == {
        "tree": "a",
        "n": 3,
        "kendall_tau": pytest.approx(1 / 3),
        "best_us": 10.0,
        "best_of_top1_us": 10.0,
        "best_of_top5_us": 10.0,
    }
    assert b["kendall_tau"] == pytest.approx(-1.0)
    assert (b["best_us"], b["best_of_top1_us"], b["best_of_top5_us"]) == (40.0, 60.0, 40.0)
    assert r.as_dict() == {
        "n_trees": 2,
        "n_trees_tau_undefined": 0,
        "mean_kendall_tau": pytest.approx(-1 / 3),
        "median_kendall_tau": pytest.approx(-1 / 3),
        "top1_score": pytest.approx(5 / 7),
        "top5_score": pytest.approx(1.0),
        "a_peak@1": pytest.approx(5 / 6),
        "a_peak@5": pytest.approx(1.0),
    }
    assert list(r.as_dict()) == [
        "n_trees",
        "n_trees_tau_undefined",
        "mean_kendall_tau",
        "median_kendall_tau",
        "top1_score",
        "top5_score",
        "a_peak@1",
        "a_peak@5",
    ]


def test_rank_median_differs_from_mean():
    # taus 1, 1, -1 (three trees of two configs): mean 1/3, median 1
    tree = [0, 0, 1, 1, 2, 2]
    meas = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
    pred = [1.0, 2.0, 1.0, 2.0, 2.0, 1.0]
    r = per_tree_rank_metrics(pred, meas, tree)
    assert r.mean_kendall_tau == pytest.approx(1 / 3)
    assert r.median_kendall_tau == pytest.approx(1.0)


def _three_trees(rng):
    sizes = [4, 7, 2]
    tree = np.repeat(np.arange(3), sizes)
    meas = rng.uniform(5.0, 500.0, size=tree.size)
    return tree, meas


def test_rank_perfect_predictor():
    tree, meas = _three_trees(np.random.default_rng(0))
    r = per_tree_rank_metrics(meas.copy(), meas, tree, ks=(1, 2, 5))
    assert r.n_trees == 3
    assert r.mean_kendall_tau == pytest.approx(1.0)
    assert r.median_kendall_tau == pytest.approx(1.0)
    assert all(v == pytest.approx(1.0) for v in r.top_k_score.values())
    assert all(v == pytest.approx(1.0) for v in r.a_peak_at_k.values())


def test_rank_reversed_predictor():
    tree, meas = _three_trees(np.random.default_rng(1))
    pred = 1000.0 - meas  # strictly decreasing in meas
    r = per_tree_rank_metrics(pred, meas, tree)
    assert r.mean_kendall_tau == pytest.approx(-1.0)
    best = np.array([meas[tree == t].min() for t in range(3)])
    worst = np.array([meas[tree == t].max() for t in range(3)])
    assert r.top_k_score[1] == pytest.approx(best.sum() / worst.sum())
    assert r.a_peak_at_k[1] == pytest.approx(np.mean(best / worst))
    # top-5: tree 0 (4 configs) and tree 2 (2 configs) are taken whole; tree 1 (7 configs) gets its 5 slowest
    best_of_top5 = np.array([best[0], np.sort(meas[tree == 1])[2], best[2]])
    assert r.top_k_score[5] == pytest.approx(best.sum() / best_of_top5.sum())
    for t, rec in enumerate(r.per_tree):
        assert rec["best_of_top1_us"] == worst[t]


def test_rank_scaled_predictor():
    tree, meas = _three_trees(np.random.default_rng(2))
    pred = 3.0 * meas
    r = per_tree_rank_metrics(pred, meas, tree)
    assert r.mean_kendall_tau == pytest.approx(1.0)
    assert r.top_k_score == {1: pytest.approx(1.0), 5: pytest.approx(1.0)}
    assert r.a_peak_at_k == {1: pytest.approx(1.0), 5: pytest.approx(1.0)}
    m = regression_metrics(pred, meas)
    assert m["mape"] == pytest.approx(2.0)
    assert m["max_ape"] == pytest.approx(2.0)
    assert m["log_rmse"] == pytest.approx(math.log(3.0))


def test_rank_ties_in_measured():
    # meas 10, 10, 20; pred 1, 2, 3: pair (0,1) tied in meas, (0,2) and (1,2) concordant
    # tau-b = (2 - 0) / sqrt((3 - 0) * (3 - 1)) = 2 / sqrt(6)
    r = per_tree_rank_metrics([1.0, 2.0, 3.0], [10.0, 10.0, 20.0], [7, 7, 7])
    assert r.per_tree[0]["kendall_tau"] == pytest.approx(2 / math.sqrt(6))
    assert r.top_k_score[1] == pytest.approx(1.0)


def test_rank_ties_in_predicted_broken_by_position():
    # pred 5, 5, 9; meas 30, 10, 20: the tied configs 0 and 1 -> config 0 (first) is the top-1 pick -> 30, best 10
    # tau-b: (0,1) tied in pred; (0,2) discordant; (1,2) concordant -> (1 - 1) / sqrt(2 * 3) = 0
    r = per_tree_rank_metrics([5.0, 5.0, 9.0], [30.0, 10.0, 20.0], [1, 1, 1], ks=(1, 2))
    assert r.per_tree[0]["best_of_top1_us"] == 30.0
    assert r.per_tree[0]["best_of_top2_us"] == 10.0
    assert r.top_k_score[1] == pytest.approx(1 / 3)
    assert r.per_tree[0]["kendall_tau"] == pytest.approx(0.0)
    # the same configs in the other order: now config 1 (meas 10) comes first among the ties
    r = per_tree_rank_metrics([5.0, 5.0, 9.0], [10.0, 30.0, 20.0], [1, 1, 1], ks=(1,))
    assert r.top_k_score[1] == pytest.approx(1.0)


def test_rank_undefined_tau_left_out():
    # tree 0: all measured equal -> tau nan; tree 1: all predicted equal -> tau nan; tree 2: tau 1
    tree = [0, 0, 0, 1, 1, 2, 2]
    meas = [5.0, 5.0, 5.0, 1.0, 2.0, 3.0, 4.0]
    pred = [1.0, 2.0, 3.0, 7.0, 7.0, 3.0, 4.0]
    r = per_tree_rank_metrics(pred, meas, tree)
    assert r.n_trees == 3
    assert r.n_trees_tau_undefined == 2
    assert math.isnan(r.per_tree[0]["kendall_tau"])
    assert math.isnan(r.per_tree[1]["kendall_tau"])
    assert r.mean_kendall_tau == pytest.approx(1.0)
    assert r.median_kendall_tau == pytest.approx(1.0)
    # undefined-tau trees still count for top-k: tree 1 picks config 3 (meas 1.0, the best), tree 0 is all 5
    assert r.top_k_score[1] == pytest.approx(1.0)


def test_rank_all_taus_undefined_gives_nan():
    r = per_tree_rank_metrics([1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 6.0, 6.0], ["x", "x", "y", "y"])
    assert r.n_trees == 2
    assert r.n_trees_tau_undefined == 2
    assert math.isnan(r.mean_kendall_tau)
    assert math.isnan(r.median_kendall_tau)
    assert math.isnan(r.as_dict()["mean_kendall_tau"])


def test_rank_single_measurement_trees_ignored():
    # trees 1..5 have one measurement each, with predictions that would rank badly: they change nothing
    base = per_tree_rank_metrics([1.0, 2.0], [10.0, 20.0], [0, 0])
    r = per_tree_rank_metrics(
        [1.0, 99.0, 2.0, 0.1, 5.0], [10.0, 1.0, 20.0, 1e4, 2.0], [0, 1, 0, 2, 3]
    )  # trees 1, 2, 3 are singletons
    assert r.n_trees == 1
    assert [t["tree"] for t in r.per_tree] == [0]
    assert r.as_dict() == base.as_dict()


def test_rank_string_and_mixed_ids():
    ids = np.array(["tree-b", "tree-a", "tree-b", "tree-a"])
    r = per_tree_rank_metrics([2.0, 1.0, 1.0, 2.0], [10.0, 10.0, 20.0, 20.0], ids)
    assert [t["tree"] for t in r.per_tree] == ["tree-a", "tree-b"]
    assert [type(t["tree"]) for t in r.per_tree] == [str, str]  # not numpy scalars
    assert [t["kendall_tau"] for t in r.per_tree] == [pytest.approx(1.0), pytest.approx(-1.0)]
    # ints and strings that do not sort together: grouped by their string form, ids reported as given
    r = per_tree_rank_metrics([1.0, 2.0, 2.0, 1.0], [1.0, 1.0, 2.0, 2.0], [3, "x", 3, "x"])
    assert r.n_trees == 2
    assert sorted(str(t["tree"]) for t in r.per_tree) == ["3", "x"]
    assert {t["tree"]: t["kendall_tau"] for t in r.per_tree} == {3: pytest.approx(1.0), "x": pytest.approx(-1.0)}


def test_rank_numpy_int_and_tuple_ids():
    r = per_tree_rank_metrics([1.0, 2.0, 1.0, 2.0], [1.0, 2.0, 1.0, 2.0], np.array([9, 9, 4, 4], dtype=np.int64))
    assert [t["tree"] for t in r.per_tree] == [4, 9]
    assert type(r.per_tree[0]["tree"]) is int
    r = per_tree_rank_metrics([1.0, 2.0, 1.0], [1.0, 2.0, 3.0], [("s", 1), ("s", 1), ("s", 2)])
    assert r.n_trees == 1
    assert r.per_tree[0]["tree"] == ("s", 1)


def test_rank_k_larger_than_tree():
    # a k above every tree's size picks whole trees: score 1 whatever the predictions
    r = per_tree_rank_metrics([3.0, 2.0, 1.0, 5.0, 4.0], [1.0, 2.0, 3.0, 4.0, 8.0], [0, 0, 0, 1, 1], ks=(1, 3, 10))
    assert r.top_k_score[10] == pytest.approx(1.0)
    assert r.top_k_score[3] == pytest.approx(1.0)
    assert r.per_tree[0]["best_of_top10_us"] == 1.0
    # top-1: tree 0 picks meas 3.0 (best 1.0); tree 1 picks meas 8.0 (best 4.0)
    assert r.top_k_score[1] == pytest.approx((1.0 + 4.0) / (3.0 + 8.0))
    assert r.a_peak_at_k[1] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert list(r.as_dict())[4:] == ["top1_score", "top3_score", "top10_score", "a_peak@1", "a_peak@3", "a_peak@10"]


def test_rank_negative_predictions_allowed():
    # only the order within a tree matters (a model may predict below zero)
    r = per_tree_rank_metrics([-3.0, -1.0, 2.0], [1.0, 2.0, 3.0], [0, 0, 0])
    assert r.mean_kendall_tau == pytest.approx(1.0)


def test_rank_metrics_is_frozen():
    r = per_tree_rank_metrics([1.0, 2.0], [1.0, 2.0], [0, 0])
    with pytest.raises(AttributeError):
        r.n_trees = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("pred", "meas", "tree", "ks", "match"),
    [
        ([1.0, 2.0], [1.0, 2.0], [0, 1], (1,), "no tree has two or more"),
        ([1.0], [1.0], [0], (1,), "no tree has two or more"),
        ([1.0, 2.0], [1.0, 2.0], [0, 0], (), "ks is empty"),
        ([1.0, 2.0], [1.0, 2.0], [0, 0], (0,), r"ks must hold integers >= 1, got 0"),
        ([1.0, 2.0], [1.0, 2.0], [0, 0], (1, -2), r"ks must hold integers >= 1, got -2"),
        ([1.0, 2.0], [1.0, 2.0], [0, 0], (1.5,), "ks must hold integers"),
        ([1.0, 2.0], [1.0, 2.0], [0, 0], (True,), "ks must hold integers"),
        ([1.0, 2.0], [1.0, 2.0, 3.0], [0, 0, 0], (1,), "same shape"),
        ([1.0, 2.0], [1.0, 2.0], [0, 0, 0], (1,), "tree_ids must have the same length"),
        ([1.0, 2.0], [1.0, 2.0], np.zeros((2, 1)), (1,), "tree_ids must be 1-D"),
        ([1.0, 2.0], [1.0, 2.0], "ab", (1,), "single string"),
        ([1.0, 2.0], [1.0, 2.0], 5, (1,), "tree_ids must be a sequence"),
        ([1.0, 2.0], [1.0, 2.0], [[0], [0]], (1,), "tree_ids must be hashable"),
        ([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [1, "1", 1, "1"], (1,), "same string form"),
        ([1.0, 2.0], [1.0, 0.0], [0, 0], (1,), "meas_us must be > 0"),
        ([1.0, 2.0], [1.0, -2.0], [0, 0], (1,), "meas_us must be > 0"),
        ([1.0, 2.0], [1.0, np.nan], [0, 0], (1,), "meas_us must be finite"),
        ([np.inf, 2.0], [1.0, 2.0], [0, 0], (1,), "pred_us must be finite"),
        ([], [], [], (1,), "empty"),
    ],
)
def test_rank_rejects_bad_input(pred, meas, tree, ks, match):
    with pytest.raises(ValueError, match=match):
        per_tree_rank_metrics(pred, meas, tree, ks=ks)


# --- randomized check against a brute-force re-implementation -------------------------------------------------------


def _brute_tau_b(p: list[float], m: list[float]) -> float:
    conc = disc = tied_p = tied_m = 0
    n = len(p)
    for i in range(n):
        for j in range(i + 1, n):
            dp, dm = p[i] - p[j], m[i] - m[j]
            if dp == 0:
                tied_p += 1
            if dm == 0:
                tied_m += 1
            if dp * dm > 0:
                conc += 1
            elif dp * dm < 0:
                disc += 1
    pairs = n * (n - 1) // 2
    denom = math.sqrt((pairs - tied_p) * (pairs - tied_m))
    return (conc - disc) / denom if denom > 0 else math.nan


def _brute_rank(pred, meas, tree, ks):
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tree):
        groups.setdefault(int(t), []).append(i)
    taus, best, best_k = [], [], {k: [] for k in ks}
    for t in sorted(groups):
        idx = groups[t]
        if len(idx) < 2:
            continue
        p = [float(pred[i]) for i in idx]
        m = [float(meas[i]) for i in idx]
        taus.append(_brute_tau_b(p, m))
        best.append(min(m))
        by_pred = sorted(range(len(idx)), key=lambda j: (p[j], j))  # ties by position
        for k in ks:
            best_k[k].append(min(m[j] for j in by_pred[:k]))
    defined = [x for x in taus if not math.isnan(x)]
    return taus, defined, best, best_k


def test_rank_random_against_brute_force():
    rng = np.random.default_rng(20261129)
    sizes = rng.integers(1, 13, size=50)
    tree = np.repeat(rng.permutation(1000)[:50], sizes)
    order = rng.permutation(tree.size)  # trees interleaved in the input
    tree = tree[order]
    # small integer latencies so that ties in meas and in pred (and undefined taus) happen
    meas = rng.integers(1, 8, size=tree.size).astype(float) * 10.0
    pred = rng.integers(1, 8, size=tree.size).astype(float) + rng.choice([0.0, 0.5], size=tree.size)
    ks = (1, 2, 5)

    r = per_tree_rank_metrics(pred, meas, tree.tolist(), ks=ks)
    taus, defined, best, best_k = _brute_rank(pred, meas, tree, ks)

    assert r.n_trees == len(best) == int(np.sum(sizes >= 2))
    assert r.n_trees_tau_undefined == len(taus) - len(defined)
    assert r.n_trees_tau_undefined > 0  # the data exercises the nan path
    assert len(defined) > 10
    np.testing.assert_allclose([t["kendall_tau"] for t in r.per_tree], taus, equal_nan=True)
    assert r.mean_kendall_tau == pytest.approx(np.mean(defined))
    assert r.median_kendall_tau == pytest.approx(np.median(defined))
    assert [t["best_us"] for t in r.per_tree] == best
    for k in ks:
        assert [t[f"best_of_top{k}_us"] for t in r.per_tree] == best_k[k]
        assert r.top_k_score[k] == pytest.approx(sum(best) / sum(best_k[k]))
        assert r.a_peak_at_k[k] == pytest.approx(np.mean(np.array(best) / np.array(best_k[k])))
    assert r.top_k_score[1] < 1.0  # a random predictor misses some best configs
    assert r.top_k_score[1] <= r.top_k_score[2] <= r.top_k_score[5] <= 1.0


# --- evaluation_table ------------------------------------------------------------------------------------------------


def test_evaluation_table_exact():
    rows = [
        ("xgb", {"n": 2061, "mape": 0.0512345, "top1_score": 0.98765, "log_rmse": 123456.0}),
        ("a|b", {"n": 7, "mape": float("nan"), "top1_score": np.float32(1.0)}),
    ]
    table = evaluation_table(rows, ["n", "mape", "top1_score", "log_rmse"])
    assert table == (
        "| model | n | mape | top1_score | log_rmse |\n"
        "| --- | ---: | ---: | ---: | ---: |\n"
        "| xgb | 2061 | 0.05123 | 0.9877 | 1.235e+05 |\n"
        "| a\\|b | 7 | nan | 1 | - |"
    )


def test_evaluation_table_header_and_no_rows():
    assert evaluation_table([], ["mape"], name_header="split") == "| split | mape |\n| --- | ---: |"


def test_evaluation_table_rejects_bad_input():
    with pytest.raises(ValueError, match="keys is empty"):
        evaluation_table([("a", {"mape": 0.1})], [])
    with pytest.raises(ValueError, match=r"rows must hold \(name, dict\) pairs"):
        evaluation_table([("a", 0.1)], ["mape"])  # type: ignore[list-item]
