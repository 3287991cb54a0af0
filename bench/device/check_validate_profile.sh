#!/usr/bin/env bash
# One device call on a 2-GPU host (run from the repo root, after `pip install -e .`):
#   GPU 0: the GPU tests, the kernel benchmark (label $LABEL), then `fasttree-tune validate` of $EXPORT on the
#          held-out workloads (measurements appended to traces/h200_validate/$LABEL.jsonl, copied to $OUT);
#   GPU 1: profiling design $SEED from the start.
# Profiling files live in /root/fasttree_traces so later calls continue them (bench/device/profile_resume.sh).
# Usage: LABEL=h200_v11 EXPORT=docs/tune/export.json SEED=8 BUDGET=560 bench/device/check_validate_profile.sh
set -u
: "${LABEL:?}" "${EXPORT:?}" "${SEED:?}" "${BUDGET:?}"
keep=/root/fasttree_traces; res=/root/fasttree_results; mkdir -p "$keep" "$res"
name="run${SEED}_${FASTTREE_GIT_COMMIT:0:7}"
CUDA_VISIBLE_DEVICES=1 timeout $((BUDGET + 20)) fasttree-tune profile --out "$keep/$name.jsonl" --budget "$((BUDGET - 15))s" \
  -n 100000 --seed "$SEED" --no-progress >>"$keep/$name.log" 2>&1 &
p1=$!
export CUDA_VISIBLE_DEVICES=0
timeout 240 python3 -m pytest -q -n 8 -p no:warnings tests/test_gpu.py tests/test_attention.py tests/test_planner.py \
  tests/test_packing.py tests/test_launch_cache.py tests/test_validate.py >"$res/gpu_tests.log" 2>&1
timeout 200 python3 -m bench.kernel --suite paper --out "$res" --label "$LABEL" >"$res/kernel.log" 2>&1
mkdir -p "$res/validate"
timeout 200 fasttree-tune validate --config "$EXPORT" --model models/h200_latency_model.skops --steps 6 \
  --traces-out "$res/validate/$LABEL.jsonl" --json "$res/validate_$LABEL.json" >"$res/validate.log" 2>&1
wait "$p1"
tail -n 3 "$res/gpu_tests.log"; tail -n 12 "$res/kernel.log"; cat "$res/validate.log" | tail -n 16
fasttree-tune traces "$keep/$name.jsonl" --skip-invalid | tail -n 4
gzip -9 -c "$keep/$name.jsonl" >"$OUT/$name.jsonl.gz"; cp "$keep/$name.log" "$res/"
tar czf "$OUT/results.tgz" -C "$res" .
