#!/usr/bin/env bash
# One device call on a 2-GPU host (repo root, after `pip install -e .`): the runtime's GPU tests and its A/B
# against tree_attention on GPU 1, then the end-to-end decode benchmark (tuned export by default) with one
# model per GPU. Results to $OUT/runtime_decode.tgz (the device returns at most 8 files: tar them).
# Usage: LABEL=h200_next bench/device/runtime_decode.sh
set -u
: "${LABEL:?}"
res=/root/fasttree_runtime; mkdir -p "$res"
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 90 python3 -m pytest -q -x -p no:warnings -p no:benchmark tests/test_runtime_gpu.py >"$res/gpu_tests.log" 2>&1
  timeout 150 python3 -m bench.runtime_ab --waves 1,2 --out "$res" --label "runtime_ab_$LABEL" >"$res/runtime_ab.log" 2>&1
  timeout 300 python3 -m bench.decode --models mistral --warmup 3 --steps 48 --out "$res" \
    --label "decode_${LABEL}_mistral" >"$res/decode_mistral.log" 2>&1
) &
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m bench.decode --models llama --warmup 3 --steps 48 --out "$res" \
  --label "decode_${LABEL}_llama" >"$res/decode_llama.log" 2>&1
wait
tail -n 2 "$res/gpu_tests.log" "$res/runtime_ab.log"; tail -n 24 "$res"/decode_*.log
tar czf "$OUT/runtime_decode.tgz" -C "$res" .
