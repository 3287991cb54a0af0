#!/usr/bin/env bash
# One device call on a 2-GPU host (repo root, after `pip install -e .`). Phase 1, in parallel:
# GPU 1 runs the GPU tests (the gpu-marked ones and the CUDA paths of the attention/planner/
# packing/launch-cache/validate tests; the optuna test files are skipped: the device has no
# optuna), then the kernel benchmark; GPU 0 runs the runtime A/B (auto vs one launch).
# Phase 2, alone on the host: the decode benchmark for llama and mistral (host contention from
# the tests' 8 pytest workers distorted it by up to 2.7x at ece6f56) and the planner's host time.
# Results to $OUT/final.tgz.
# Usage: LABEL=h200_<commit> bash bench/device/final_check.sh
set -u
: "${LABEL:?}"
res=/root/fasttree_final; mkdir -p "$res"
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 240 python3 -m pytest -q -n 8 -p no:warnings -p no:benchmark --ignore tests/test_cli_tune.py \
    --ignore tests/test_tuner.py -m gpu tests >"$res/gpu_tests_marked.log" 2>&1
  timeout 240 python3 -m pytest -q -n 8 -p no:warnings tests/test_gpu.py tests/test_attention.py tests/test_planner.py \
    tests/test_packing.py tests/test_launch_cache.py tests/test_validate.py >"$res/gpu_tests.log" 2>&1
  timeout 200 python3 -m bench.kernel --suite paper --out "$res" --label "$LABEL" >"$res/kernel.log" 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 150 python3 -m bench.runtime_ab --stage1-launches auto,1 --waves 1 --out "$res" \
    --label "runtime_ab_$LABEL" >"$res/runtime_ab.log" 2>&1
) &
wait
(
  export CUDA_VISIBLE_DEVICES=0
  for model in llama mistral; do
    timeout 150 python3 -m bench.decode --models $model --warmup 3 --steps 48 --out "$res" \
      --label "decode_${LABEL}_$model" >"$res/decode_$model.log" 2>&1
  done
  timeout 120 python3 -m bench.plan_host --json "$res/plan_host_$LABEL.json" >"$res/plan_host.log" 2>&1
)
tail -n 2 "$res"/gpu_tests*.log "$res/runtime_ab.log"; grep -A9 "^Summary" "$res"/kernel_*.md
tail -n 21 "$res"/decode_*.log | cut -c1-160; cat "$res/plan_host.log"
tar czf "$OUT/final.tgz" -C "$res" .
