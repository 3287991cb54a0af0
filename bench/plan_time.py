"""Host planning time of :func:`fasttree.plan` on the FastTree paper suite and large trees of other families.

For every paper-suite tree (``fasttree.toolkit.suite.PAPER_SUITE``, 15 cases) crossed with every head
setting (``fasttree.toolkit.suite.PAPER_HEADS``: mha 32/32, gqa4 32/8, gqa16 16/1), head_dim 128 and the
default :class:`fasttree.FastTreeConfig`, this script

* builds the tree once with ``paper_tree(case)`` and times that build ("tree_ms"),
* warms the planner up with a few calls, then times ``--repeats`` calls of ``fasttree.plan`` with
  :func:`time.perf_counter` and reports the median ("plan_ms") and 90th percentile ("plan_p90_ms"),
* records the plan's tile mode, units per tile class and partial-row count, and the tree's size,
* sets the result beside the published FastTree planner's time for the same case;

then does the same (without a published time) for the trees of :func:`family_trees` (100k+ tokens and
1,000+ queries each: a forest with internal queries, speculative token trees, beams, documents, a
few-shot fan-out), summarised apart from the paper suite.

Outputs ``plan_time_<label>.json`` and ``plan_time_<label>.md`` under ``--out`` (written
atomically) and prints the markdown table to stdout.

Run from the repository root::

    python -m bench.plan_time [--repeats 200] [--warmup 5] [--out docs/results] [--label cpu]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import fasttree
from fasttree.fileio import write_atomic
from fasttree.planner import unprepared
from fasttree.toolkit import workloads
from fasttree.toolkit.bench_common import anchor_rows, environment
from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE, paper_tree

log = logging.getLogger("bench.plan_time")

HEAD_DIM = 128

#: Published FastTree planner time (ms) per (case, heads) from the project's anchors file
#: (``fasttree/toolkit/data/anchors_h200_paper_suite.json``): measured on an H200 host, 2026-11-29, published
#: planner incl. index upload, while ``plan_ms`` here is host planning only.
PUBLISHED_PLAN_MS: dict[int, dict[str, float]] = {}
for (_case, _heads), _row in anchor_rows().items():
    PUBLISHED_PLAN_MS.setdefault(_case, {})[_heads] = _row["published_fasttree_plan_ms"]


def forest(trees: list[fasttree.KVTree]) -> fasttree.KVTree:
    """The trees side by side as one forest (node ids and contiguous slots in the given order)."""
    parents, lengths, queries = [], [], []
    offset = 0
    for t in trees:
        parents.append(np.where(t.parents >= 0, t.parents + offset, -1))
        lengths.append(t.lengths)
        queries.append(t.query_nodes + offset)
        offset += t.n_nodes
    return fasttree.KVTree.from_lengths(np.concatenate(parents), np.concatenate(lengths), np.concatenate(queries))


def _forest_internal() -> fasttree.KVTree:
    rng = np.random.default_rng(43)
    return forest(
        [workloads.random_recursive(rng, n_nodes=256, max_node_tokens=512, internal_query_prob=0.3) for _ in range(8)]
    )


#: Builders of the large trees beside the paper suite (see :func:`family_trees`).
FAMILY_BUILDERS: dict[str, Callable[[], fasttree.KVTree]] = {
    "forest_internal": _forest_internal,
    "speculative": lambda: workloads.speculative(
        np.random.default_rng(1), n_requests=16, n_token_nodes=64, max_depth=8, prompt_tokens=(6144, 8192)
    ),
    "beam": lambda: workloads.beam_search(
        np.random.default_rng(2), width=32, depth=8, n_prompts=32, prompt_tokens=(3072, 4096)
    ),
    "multi_document": lambda: workloads.multi_document(
        np.random.default_rng(3), n_documents=64, doc_tokens=(1536, 2560), questions_per_doc=(16, 16)
    ),
    "few_shot": lambda: workloads.few_shot(
        np.random.default_rng(4), prompt_tokens=8192, n_questions=2048, question_tokens=(32, 96)
    ),
}


def family_trees() -> dict[str, fasttree.KVTree]:
    """Large trees of the families beside the paper suite (seeded: the same trees every run).

    * ``forest_internal``: 8 random recursive trees of 256 nodes (up to 512 tokens each) side by
      side, queries at every leaf and at 30% of the internal nodes (170k tokens, 1,353 queries);
    * ``speculative``: 16 requests with 6-8k-token prompts and 64 one-token draft nodes each,
      at most 8 deep, one query per draft token (113k tokens, 1,024 queries);
    * ``beam``: 32 beam searches of width 32 over 8 rounds from 3-4k-token prompts (158k tokens,
      1,024 queries);
    * ``multi_document``: 64 documents of 1.5-2.5k tokens with 16 questions each (197k tokens,
      1,024 queries);
    * ``few_shot``: one 8k-token prompt with 2,048 questions of 32-96 tokens (140k tokens, 2,048
      queries).
    """
    return {name: build() for name, build in FAMILY_BUILDERS.items()}


def minor_page_faults() -> int | None:
    """This process's minor page faults so far (None where the platform does not count them)."""
    try:
        import resource
    except ImportError:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def bench_case(case: int | str, heads: str, repeats: int, warmup: int) -> dict[str, Any]:
    """Time tree build and planning of one (case, heads) pair; ``case`` is a paper-suite case
    number or a :func:`family_trees` name."""
    num_q_heads, num_kv_heads = PAPER_HEADS[heads]
    config = fasttree.FastTreeConfig()

    t0 = time.perf_counter()
    tree = paper_tree(case) if isinstance(case, int) else FAMILY_BUILDERS[case]()
    tree_ms = (time.perf_counter() - t0) * 1e3

    plan = None
    for _ in range(warmup):
        plan = fasttree.plan(tree, config, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM)

    times = np.empty(repeats, dtype=np.float64)
    faults0 = minor_page_faults()
    for i in range(repeats):
        t0 = time.perf_counter()
        plan = fasttree.plan(tree, config, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM)
        times[i] = time.perf_counter() - t0
    faults1 = minor_page_faults()
    assert plan is not None
    times *= 1e3
    # a server plans a new tree object every step: the planner's per-tree index is built each time
    fresh_trees = [unprepared(tree) for _ in range(repeats)]
    fresh = np.empty(repeats, dtype=np.float64)
    for i, t in enumerate(fresh_trees):
        t0 = time.perf_counter()
        fasttree.plan(t, config, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM)
        fresh[i] = time.perf_counter() - t0
    del fresh_trees
    fresh *= 1e3

    plan_ms = float(np.median(times))
    published = PUBLISHED_PLAN_MS.get(case, {}).get(heads) if isinstance(case, int) else None
    return {
        "case": case,
        "heads": heads,
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": HEAD_DIM,
        "n_nodes": int(tree.n_nodes),
        "n_queries": int(tree.n_queries),
        "n_tokens": int(tree.num_tokens),
        "tree_ms": tree_ms,
        "plan_ms": plan_ms,
        "plan_p90_ms": float(np.percentile(times, 90)),
        "plan_min_ms": float(times.min()),
        "fresh_plan_ms": float(np.median(fresh)),
        # fresh pages the allocator handed the planner per call (0 once its host memory is reused)
        "page_faults_per_plan": None if faults0 is None or faults1 is None else (faults1 - faults0) / repeats,
        "repeats": repeats,
        "published_plan_ms": published,
        "speedup_vs_published": (published / plan_ms) if published is not None and plan_ms > 0 else None,
        "tile_mode": plan.tile_mode,
        "units_per_class": [int(u) for u in plan.units_per_class()],
        "n_partial_rows": int(plan.n_partial_rows),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Max and median plan_ms over all rows and how many rows plan in at most 1 ms."""
    plan_ms = np.array([r["plan_ms"] for r in rows], dtype=np.float64)
    fresh_ms = np.array([r["fresh_plan_ms"] for r in rows], dtype=np.float64)
    speedups = np.array([r["speedup_vs_published"] for r in rows if r["speedup_vs_published"] is not None])
    worst = rows[int(plan_ms.argmax())]
    return {
        "n_rows": len(rows),
        "max_plan_ms": float(plan_ms.max()),
        "max_plan_case": f"{worst['case']}/{worst['heads']}",
        "median_plan_ms": float(np.median(plan_ms)),
        "rows_le_1ms": int((plan_ms <= 1.0).sum()),
        "max_fresh_plan_ms": float(fresh_ms.max()),
        "median_fresh_plan_ms": float(np.median(fresh_ms)),
        "median_speedup_vs_published": float(np.median(speedups)) if speedups.size else None,
        "min_speedup_vs_published": float(speedups.min()) if speedups.size else None,
    }


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _loaded(native: bool | None) -> str:
    """How the markdown names ``env["native_planner"]`` (absent in results written before it)."""
    return "unknown" if native is None else ("loaded" if native else "NOT loaded (numpy path)")


def markdown(
    rows: list[dict[str, Any]],
    summary: dict[str, Any],
    env: dict[str, Any],
    label: str,
    family_rows: list[dict[str, Any]] | None = None,
    family_summary: dict[str, Any] | None = None,
) -> str:
    """Markdown table of all rows followed by summary lines, then the other families' table."""
    lines = [
        f"# fasttree.plan host planning time ({label})",
        "",
        f"head_dim {HEAD_DIM}, default FastTreeConfig, median / p90 of {rows[0]['repeats'] if rows else 0} calls. "
        "faults: minor page faults per timed call (fresh pages from the allocator). "
        "published_ms: published FastTree planner on an H200 host incl. index upload (2026-11-29). "
        "fresh_ms: median plan of a new tree object each call (the planner's per-tree index built every "
        "time, as a server planning each step's new tree pays it; tree construction itself is tree_ms).",
        "",
        "| case | heads | nodes | queries | tree_ms | plan_ms | p90_ms | fresh_ms | faults | published_ms | speedup "
        "| mode |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|",
    ]
    for r in rows:
        speedup = r["speedup_vs_published"]
        lines.append(
            f"| {r['case']} | {r['heads']} | {r['n_nodes']} | {r['n_queries']} | {_fmt(r['tree_ms'])} "
            f"| {_fmt(r['plan_ms'])} | {_fmt(r['plan_p90_ms'])} | {_fmt(r.get('fresh_plan_ms'))} "
            f"| {_fmt(r.get('page_faults_per_plan'), 0)} | {_fmt(r['published_plan_ms'], 2)} "
            f"| {'-' if speedup is None else f'{speedup:.1f}x'} | {r['tile_mode']} |"
        )
    lines += [
        "",
        f"- max plan_ms: {summary['max_plan_ms']:.3f} (case {summary['max_plan_case']})",
        f"- median plan_ms: {summary['median_plan_ms']:.3f}",
        f"- rows with plan_ms <= 1 ms: {summary['rows_le_1ms']} / {summary['n_rows']}",
        f"- fresh trees: median {summary['median_fresh_plan_ms']:.3f} ms, max {summary['max_fresh_plan_ms']:.3f} ms",
    ]
    if summary["median_speedup_vs_published"] is not None:
        lines.append(
            f"- speedup vs published: median {summary['median_speedup_vs_published']:.1f}x, "
            f"min {summary['min_speedup_vs_published']:.1f}x"
        )
    if family_rows:
        lines += [
            "",
            "## Large trees of other families",
            "",
            "| tree | heads | nodes | queries | tokens | tree_ms | plan_ms | p90_ms | fresh_ms | faults | mode |",
            "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|:---|",
        ]
        for r in family_rows:
            lines.append(
                f"| {r['case']} | {r['heads']} | {r['n_nodes']} | {r['n_queries']} | {r['n_tokens']} "
                f"| {_fmt(r['tree_ms'])} | {_fmt(r['plan_ms'])} | {_fmt(r['plan_p90_ms'])} "
                f"| {_fmt(r.get('fresh_plan_ms'))} | {_fmt(r.get('page_faults_per_plan'), 0)} | {r['tile_mode']} |"
            )
        assert family_summary is not None
        lines += [
            "",
            f"- max plan_ms: {family_summary['max_plan_ms']:.3f} ({family_summary['max_plan_case']})",
            f"- median plan_ms: {family_summary['median_plan_ms']:.3f}",
            f"- rows with plan_ms <= 1 ms: {family_summary['rows_le_1ms']} / {family_summary['n_rows']}",
            f"- fresh trees: median {family_summary['median_fresh_plan_ms']:.3f} ms, "
            f"max {family_summary['max_fresh_plan_ms']:.3f} ms",
            "",
        ]
    lines.append(
        f"- env: {env['cpu_model'] or env['processor'] or env['machine']}, python {env['python']}, "
        f"numpy {env['numpy']}, fasttree {env['fasttree']}, commit {(env['git_commit'] or 'unknown')[:12]}, "
        f"compiled planner loops {_loaded(env.get('native_planner'))}, {env['timestamp_utc']}"
    )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.plan_time",
        description="Measure host planning time of fasttree.plan on the 15 paper-suite trees x 3 head settings "
        f"(head_dim {HEAD_DIM}, default config) and compare with the published FastTree planner.",
    )
    parser.add_argument("--repeats", type=int, default=200, help="timed plan() calls per case (default: 200)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed plan() calls before timing (default: 5)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder (default: docs/results)")
    parser.add_argument(
        "--label", default="cpu", help="label in the output names plan_time_<label>.json/.md (default: cpu)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every case")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    env = environment()
    log.info("env: %s", env)

    rows: list[dict[str, Any]] = []
    for case in sorted(PAPER_SUITE):
        for heads in PAPER_HEADS:
            row = bench_case(case, heads, args.repeats, args.warmup)
            rows.append(row)
            log.info(
                "case %2d %-5s plan %.3f ms (p90 %.3f), published %s ms, mode %s",
                case,
                heads,
                row["plan_ms"],
                row["plan_p90_ms"],
                row["published_plan_ms"],
                row["tile_mode"],
            )

    family_rows: list[dict[str, Any]] = []
    for name in FAMILY_BUILDERS:
        for heads in PAPER_HEADS:
            row = bench_case(name, heads, args.repeats, args.warmup)
            family_rows.append(row)
            log.info("%s %-5s plan %.3f ms (p90 %.3f), mode %s", name, heads, row["plan_ms"], row["plan_p90_ms"],
                     row["tile_mode"])  # fmt: skip

    summary = summarize(rows)
    family_summary = summarize(family_rows)
    report = {
        "benchmark": "fasttree.plan host planning time, paper suite and large trees of other families",
        "label": args.label,
        "head_dim": HEAD_DIM,
        "config": "FastTreeConfig() defaults",
        "repeats": args.repeats,
        "warmup": args.warmup,
        "published_source": "measured on an H200 host, 2026-11-29, published FastTree planner incl. index upload",
        "env": env,
        "summary": summary,
        "rows": rows,
        "family_summary": family_summary,
        "family_rows": family_rows,
    }
    md = markdown(rows, summary, env, args.label, family_rows, family_summary)
    json_path = args.out / f"plan_time_{args.label}.json"
    md_path = args.out / f"plan_time_{args.label}.md"
    write_atomic(json_path, json.dumps(report, indent=2) + "\n")
    write_atomic(md_path, md)
    log.info("wrote %s and %s", json_path, md_path)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
