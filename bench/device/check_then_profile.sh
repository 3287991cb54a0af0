#!/usr/bin/env bash
# One device call on a 2-GPU host (run from the repo root, after `pip install -e .`):
#   GPU 0: the GPU tests, the host-overhead probe and the kernel benchmark (label $LABEL), then profiling;
#   GPU 1: profiling from the start.
# GPU 1 profiles design $SEED and GPU 0 design $SEED+1 (two processes on one design would measure the same points),
# into files kept on the machine (/root/fasttree_traces), so a later call on the warm machine continues them.
# Usage: LABEL=h200_v10 SEED=5 BUDGET=480 bench/device/check_then_profile.sh
set -u
: "${LABEL:?}" "${SEED:?}" "${BUDGET:?}"
keep=/root/fasttree_traces; mkdir -p "$keep"
name="run${SEED}_${FASTTREE_GIT_COMMIT:0:7}"
name0="run$((SEED + 1))_${FASTTREE_GIT_COMMIT:0:7}"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=1 fasttree-tune profile --out "$keep/$name.jsonl" --budget "${BUDGET}s" -n 100000 --seed "$SEED" \
  --no-progress >>"$keep/$name.log" 2>&1 &
p1=$!
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 -m pytest -q -n 8 -p no:warnings tests/test_gpu.py tests/test_attention.py tests/test_planner.py \
  tests/test_packing.py >"$OUT/gpu_tests.log" 2>&1; tail -n 3 "$OUT/gpu_tests.log"
timeout 60 python3 -m bench.host_overhead >"$OUT/host_overhead.log" 2>&1; cat "$OUT/host_overhead.log"
timeout 200 python3 -m bench.kernel --suite paper --out "$OUT" --label "$LABEL" >"$OUT/kernel.log" 2>&1
tail -n 12 "$OUT/kernel.log"
left=$(( BUDGET - ($(date +%s) - t0) ))
if [ "$left" -gt 30 ]; then
  fasttree-tune profile --out "$keep/$name0.jsonl" --budget "${left}s" -n 100000 --seed "$((SEED + 1))" \
    --no-progress >>"$keep/$name0.log" 2>&1
fi
wait "$p1"
for n in "$name" "$name0"; do
  [ -f "$keep/$n.jsonl" ] || continue
  fasttree-tune traces "$keep/$n.jsonl" --skip-invalid | tail -n 4
  gzip -9 -c "$keep/$n.jsonl" >"$OUT/$n.jsonl.gz"
  cp "$keep/$n.log" "$OUT/$n.log"
done
