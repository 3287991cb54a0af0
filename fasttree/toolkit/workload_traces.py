"""Write the tuner's workload traces: the paper suite and the four serving scenarios.

Each file holds ``kind: "workload"`` lines (see ``traces/README.md``): one decode-step
tree each, with the model's head shape, for the tuner to optimise over. The serving
scenarios are simulated with :func:`fasttree.toolkit.workloads.iter_serving` (requests arrive,
share prefixes, grow a token per step and finish) for a Llama-2-7B-shaped model (32 query
and 32 KV heads) and a Mistral-7B-shaped one (GQA 4: 32 / 8), head dim 128, fp16.

Run from the repository root::

    python -m fasttree.toolkit.workload_traces --out fasttree/toolkit/data/workloads
    python -m fasttree.toolkit.workload_traces --out fasttree/toolkit/data/workloads_heldout --seed 1 --no-paper-suite

The second set (other arrivals, prompts and lengths of the same scenarios) is the tuner's
held-out workloads: tune on ``workloads``, judge on ``workloads_heldout``. Both are package data
(:mod:`fasttree.toolkit.shipped`), the defaults of ``fasttree-tune run``.
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
from .workloads import SCENARIOS, iter_serving

log = logging.getLogger(__name__)

#: Model shapes of the end-to-end scenarios: name -> (num_q_heads, num_kv_heads, head_dim).
MODELS: dict[str, tuple[int, int, int]] = {"llama2_7b": (32, 32, 128), "mistral_7b": (32, 8, 128)}


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


def write_all(out: Path, *, steps: int = 256, seed: int = 0, paper_suite: bool = True) -> dict[str, int]:
    """Write ``<scenario>_<model>.jsonl.gz`` and (with ``paper_suite``) ``paper_suite.jsonl.gz`` under ``out``.

    Returns the number of lines per file name.
    """
    written = {}
    if paper_suite:
        written["paper_suite.jsonl.gz"] = _write_gz(out / "paper_suite.jsonl.gz", paper_suite_records())
    for scenario in SCENARIOS:
        for model in MODELS:
            name = f"{scenario}_{model}.jsonl.gz"
            written[name] = _write_gz(out / name, scenario_records(scenario, model, steps=steps, seed=seed))
            log.info("%s: %d steps", name, written[name])
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fasttree.toolkit.workload_traces", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("fasttree/toolkit/data/workloads"), help="output folder")
    parser.add_argument("--steps", type=int, default=256, help="decode steps per scenario (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="simulation seed (default 0)")
    parser.add_argument(
        "--no-paper-suite", dest="paper_suite", action="store_false", help="write only the serving scenarios"
    )
    args = parser.parse_args(argv)
    try:
        check_int("--steps", args.steps, minimum=1)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    written = write_all(args.out, steps=args.steps, seed=args.seed, paper_suite=args.paper_suite)
    check = read_traces(args.out, kind="workload")
    if len(check) != sum(written.values()):
        print(f"read back {len(check)} lines, wrote {sum(written.values())}", file=sys.stderr)
        return 1
    for name, n in written.items():
        print(f"{args.out / name}: {n} workload lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
