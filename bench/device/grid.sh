#!/usr/bin/env bash
# One device call on a 2-GPU host (repo root, after `pip install -e .`): the GPU grid search of bench.grid
# for GQA 1 on GPU 0 and GQA 4 on GPU 1 at the same time; results to $OUT/grid.tgz.
# Usage: EXPORT=docs/tune/export.json STEPS=3 bench/device/grid.sh
set -u
: "${EXPORT:?}" "${STEPS:?}"
res=/root/fasttree_grid; mkdir -p "$res"
CUDA_VISIBLE_DEVICES=0 python3 -m bench.grid --export "$EXPORT" --group-size 1 --steps "$STEPS" --out "$res" >"$res/grid_g1.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 -m bench.grid --export "$EXPORT" --group-size 4 --steps "$STEPS" --out "$res" >"$res/grid_g4.log" 2>&1 &
wait
tail -n 3 "$res"/grid_g*.log
tar czf "$OUT/grid.tgz" -C "$res" .
