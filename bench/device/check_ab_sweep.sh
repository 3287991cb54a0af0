#!/usr/bin/env bash
# One device call on a 2-GPU host (run from the repo root, after `pip install -e .`), then profiling with what is left.
#   GPU 0: the GPU tests, the host-overhead probe and the full kernel benchmark (label $LABEL);
#   GPU 1: an A/B of this tree against an experiment ($EXP: a branch's files laid out as an importable package,
#          `fasttree/kernels` etc. inside `fasttree/`, with commit $EXP_COMMIT), fasttree variant only, then the
#          launch-settings sweep $GRID.
# Each GPU then profiles its own design ($SEED on GPU 1, $SEED+1 on GPU 0) into /root/fasttree_traces until $BUDGET
# seconds after the start. Results go to $OUT as one tarball (the device returns few files) plus gzipped traces.
# Usage: LABEL=h200_v10 EXP=.exp/vm EXP_COMMIT=abc1234 GRID=warps SEED=5 BUDGET=560 bench/device/check_ab_sweep.sh
set -u
: "${LABEL:?}" "${EXP:?}" "${EXP_COMMIT:?}" "${GRID:?}" "${SEED:?}" "${BUDGET:?}"
t0=$(date +%s)
keep=/root/fasttree_traces; res=/root/fasttree_results; mkdir -p "$keep" "$res"
main_commit=${FASTTREE_GIT_COMMIT:0:7}
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
profile() {  # GPU SEED: profile until the budget is spent
  local name="run$2_${main_commit}" l; l=$(left)
  [ "$l" -gt 40 ] || return 0
  CUDA_VISIBLE_DEVICES=$1 timeout $((l + 20)) fasttree-tune profile --out "$keep/$name.jsonl" --budget "$((l - 15))s" \
    -n 100000 --seed "$2" --no-progress >>"$keep/$name.log" 2>&1
}
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 240 python3 -m pytest -q -n 8 -p no:warnings tests/test_gpu.py tests/test_attention.py tests/test_planner.py tests/test_packing.py \
    tests/test_launch_cache.py >"$res/gpu_tests.log" 2>&1
  timeout 60 python3 -m bench.host_overhead >"$res/host_overhead.log" 2>&1
  timeout 240 python3 -m bench.kernel --suite paper --out "$res" --label "$LABEL" >"$res/kernel.log" 2>&1
  profile 0 $((SEED + 1))
) &
g0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m bench.kernel --variants fasttree --out "$res/ab" --label "ab_main_${main_commit}" \
    >"$res/ab_main.log" 2>&1
  (cd "$EXP" && FASTTREE_GIT_COMMIT=$EXP_COMMIT timeout 150 python3 -m bench.kernel --variants fasttree \
    --out "$res/ab" --label "ab_exp_${EXP_COMMIT:0:7}" >"$res/ab_exp.log" 2>&1)
  timeout 200 python3 -m bench.sweep --grid "$GRID" --cases 1,5,6,8,9,10,11,13 --out "$res" \
    --label "${LABEL}_${GRID}_${main_commit}" >"$res/sweep.log" 2>&1
  profile 1 "$SEED"
) &
g1=$!
wait $g0 $g1
tail -n 3 "$res/gpu_tests.log"; cat "$res/host_overhead.log"; tail -n 8 "$res/kernel.log"
for f in ab_main ab_exp sweep; do echo "== $f"; tail -n 14 "$res/$f.log"; done
for s in "$SEED" $((SEED + 1)); do
  n="run${s}_${main_commit}"; [ -f "$keep/$n.jsonl" ] || continue
  fasttree-tune traces "$keep/$n.jsonl" --skip-invalid | tail -n 4
  gzip -9 -c "$keep/$n.jsonl" >"$OUT/$n.jsonl.gz"; cp "$keep/$n.log" "$res/"
done
tar czf "$OUT/results.tgz" -C "$res" .
