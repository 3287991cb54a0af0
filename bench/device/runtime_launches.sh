#!/usr/bin/env bash
# One device call on a 2-GPU host (repo root, after `pip install -e .`): the runtime's GPU tests on GPU 1,
# and on GPU 0 the runtime A/B against tree_attention with stage 1 as one launch or one per tile class,
# crossed with waves 1 and 2. Results to $OUT/runtime_launches.tgz.
# Usage: LABEL=h200_<commit> bash bench/device/runtime_launches.sh
set -u
: "${LABEL:?}"
res=/root/fasttree_launches; mkdir -p "$res"
CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m pytest -q -p no:warnings -p no:benchmark tests/test_runtime_gpu.py \
  >"$res/gpu_tests_runtime.log" 2>&1 &
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m bench.runtime_ab --stage1-launches 1,2 --waves 1,2 --out "$res" \
  --label "runtime_ab_$LABEL" >"$res/runtime_ab.log" 2>&1
wait
tail -n 3 "$res/gpu_tests_runtime.log"; tail -n 4 "$res/runtime_ab.log"
tar czf "$OUT/runtime_launches.tgz" -C "$res" .
