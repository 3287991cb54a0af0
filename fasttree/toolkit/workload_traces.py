"""Write the tuner's workload traces: the paper suite, the serving scenarios and the tree families.

Each file holds ``kind: "workload"`` lines (see ``traces/README.md``): one tree each, with a
model's head shape, for the tuner to optimise over. The serving scenarios are simulated with
:func:`fasttree.toolkit.workloads.iter_serving` (requests arrive, share prefixes, grow a token per
step and finish); the tree families are :data:`fasttree.toolkit.workloads.TREE_FAMILIES` (tuning)
or :data:`fasttree.toolkit.unseen_families.UNSEEN_FAMILIES` (the frozen test). Model shapes: a
Llama-2-7B-shaped model (32 query and 32 KV heads), a Mistral-7B-shaped one (GQA 4: 32 / 8) and a
GQA-16 one (32 / 2), head dim 128, fp16.

Run from the repository root (the three splits of the tuned export's protocol, ``docs/tune/protocol.md``)::

    python -m fasttree.toolkit.workload_traces --out fasttree/toolkit/data/workloads --families 16
    python -m fasttree.toolkit.workload_traces --out fasttree/toolkit/data/workloads_heldout --seed 1 \
        --no-paper-suite --families 8 --family-seed 1000
    python -m fasttree.toolkit.workload_traces --out fasttree/toolkit/data/workloads_test --no-paper-suite \
        --no-serving --unseen 6 --unseen-seed 100

Tune on ``workloads``, make every design choice on ``workloads_heldout`` (other arrivals, prompts
and lengths of the same scenarios, other seeds of the same families), and test on
``workloads_test`` (families nothing else uses) and the paper suite. All three are package data
(:func:`fasttree.toolkit.shipped.workloads_path`), the defaults of ``fasttree-tune run`` and
``validate``.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..traces import TraceWriter, read_traces, workload_record
from ..validation import check_int
from .suite import PAPER_HEADS, PAPER_SUITE, paper_tree
from .unseen_families import UNSEEN_FAMILIES, sample_unseen_tree
from .workloads import SCENARIOS, TREE_FAMILIES, iter_serving, sample_tree

log = logging.getLogger(__name__)

#: Model shapes of the end-to-end scenarios: name -> (num_q_heads, num_kv_heads, head_dim).
MODELS: dict[str, tuple[int, int, int]] = {
    "llama2_7b": (32, 32, 128),
    "mistral_7b": (32, 8, 128),
    "gqa16_7b": (32, 2, 128),
}


def _write_gz(path: Path, records) -> int:
    """Write records through a TraceWriter into a temporary .jsonl, then gzip it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        plain = Path(tmp) / path.name.removesuffix(".gz")
        n = 0
        with TraceWriter(plain, fsync=False) as writer:
            for record in records:
                writer.append(record)
                n += 1
        packed = Path(tmp) / path.name
        with open(plain, "rb") as src, gzip.GzipFile(packed, "wb", mtime=0) as dst:
            shutil.copyfileobj(src, dst)
        os.replace(packed, path)
    return n


def paper_suite_records():
    """The 15 paper-suite trees under each of the suite's head settings, fp16, weight 1."""
    for case in sorted(PAPER_SUITE):
        tree = paper_tree(case)
        for heads, (hq, hkv) in PAPER_HEADS.items():
            yield workload_record(
                family="paper",
                scenario=f"paper_suite_{heads}",
                step=case,
                seed=None,
                tree=tree,
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_dim=128,
                dtype="float16",
            )


def scenario_records(scenario: str, model: str, *, steps: int, seed: int):
    """One record per decode step of a simulated serving run."""
    hq, hkv, d = MODELS[model]
    for step in iter_serving(scenario, seed=seed, steps=steps):
        yield workload_record(
            family="serving",
            scenario=scenario,
            step=step.step,
            seed=seed,
            tree=step.tree,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            dtype="float16",
            meta={"model": model},
        )


def family_records(model: str, *, per_family: int, first_seed: int, unseen: bool = False):
    """``per_family`` trees of every tree family (seeds ``first_seed``, ``first_seed + 1``, ...), one
    record each under the model's heads; ``unseen``: the families of the frozen test."""
    hq, hkv, d = MODELS[model]
    families = UNSEEN_FAMILIES if unseen else TREE_FAMILIES
    draw = sample_unseen_tree if unseen else sample_tree
    for family in families:
        for seed in range(first_seed, first_seed + per_family):
            yield workload_record(
                family=family,
                scenario="unseen" if unseen else "families",
                step=0,
                seed=seed,
                tree=draw(family, seed),
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_dim=d,
                dtype="float16",
                meta={"model": model, "split": "test" if unseen else "families"},
            )


def write_all(
    out: Path,
    *,
    steps: int = 256,
    seed: int = 0,
    paper_suite: bool = True,
    serving: bool = True,
    families: int = 0,
    family_seed: int = 0,
    unseen: int = 0,
    unseen_seed: int = 0,
) -> dict[str, int]:
    """Write the workload files under ``out``: ``paper_suite.jsonl.gz`` (with ``paper_suite``),
    ``<scenario>_<model>.jsonl.gz`` (with ``serving``), ``families_<model>.jsonl.gz`` (``families``
    trees of each tuning family) and ``unseen_<model>.jsonl.gz`` (``unseen`` trees of each family
    of the frozen test).

    Returns the number of lines per file name.
    """
    written = {}
    if paper_suite:
        written["paper_suite.jsonl.gz"] = _write_gz(out / "paper_suite.jsonl.gz", paper_suite_records())
    for model in MODELS:
        if serving:
            for scenario in SCENARIOS:
                name = f"{scenario}_{model}.jsonl.gz"
                written[name] = _write_gz(out / name, scenario_records(scenario, model, steps=steps, seed=seed))
        if families:
            name = f"families_{model}.jsonl.gz"
            records = family_records(model, per_family=families, first_seed=family_seed)
            written[name] = _write_gz(out / name, records)
        if unseen:
            name = f"unseen_{model}.jsonl.gz"
            records = family_records(model, per_family=unseen, first_seed=unseen_seed, unseen=True)
            written[name] = _write_gz(out / name, records)
    for name, n in written.items():
        log.info("%s: %d lines", name, n)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fasttree.toolkit.workload_traces", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("fasttree/toolkit/data/workloads"), help="output folder")
    parser.add_argument("--steps", type=int, default=256, help="decode steps per scenario (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="simulation seed (default 0)")
    parser.add_argument("--no-paper-suite", dest="paper_suite", action="store_false", help="no paper-suite file")
    parser.add_argument("--no-serving", dest="serving", action="store_false", help="no serving-scenario files")
    parser.add_argument("--families", type=int, default=0, help="trees of each tuning family per model (default 0)")
    parser.add_argument("--family-seed", type=int, default=0, help="first seed of the family trees (default 0)")
    parser.add_argument("--unseen", type=int, default=0, help="trees of each unseen (test) family per model")
    parser.add_argument("--unseen-seed", type=int, default=0, help="first seed of the unseen trees (default 0)")
    args = parser.parse_args(argv)
    try:
        check_int("--steps", args.steps, minimum=1)
        for name in ("families", "family_seed", "unseen", "unseen_seed"):
            check_int(f"--{name.replace('_', '-')}", getattr(args, name), minimum=0)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    written = write_all(
        args.out, steps=args.steps, seed=args.seed, paper_suite=args.paper_suite, serving=args.serving,
        families=args.families, family_seed=args.family_seed, unseen=args.unseen, unseen_seed=args.unseen_seed,
    )  # fmt: skip
    check = read_traces(args.out, kind="workload")
    if len(check) != sum(written.values()):
        print(f"read back {len(check)} lines, wrote {sum(written.values())}", file=sys.stderr)
        return 1
    for name, n in written.items():
        print(f"{args.out / name}: {n} workload lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
