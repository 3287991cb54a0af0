#!/usr/bin/env bash
# One device call on a 2-GPU host (repo root, after `pip install -e .`). GPU 1: the GPU tests (all of
# `pytest -m gpu`), then the runtime A/B against tree_attention (stage1_launches auto and 1). GPU 0: the
# end-to-end decode benchmark (tuned export, fused non-attention ops) for llama and mistral, then the
# same with --unfused (the torch-op decoder of earlier runs). Results to $OUT/runtime_decode.tgz.
# Usage: LABEL=h200_<commit> bash bench/device/runtime_decode.sh
set -u
: "${LABEL:?}"
res=/root/fasttree_runtime; mkdir -p "$res"
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 -m pytest -q -m gpu -p no:warnings -p no:benchmark tests >"$res/gpu_tests.log" 2>&1
  timeout 200 python3 -m bench.runtime_ab --stage1-launches auto,1 --waves 1 --out "$res" \
    --label "runtime_ab_$LABEL" >"$res/runtime_ab.log" 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=0
  for model in llama mistral; do
    timeout 150 python3 -m bench.decode --models $model --warmup 3 --steps 48 --out "$res" \
      --label "decode_${LABEL}_$model" >"$res/decode_$model.log" 2>&1
  done
  for model in llama mistral; do
    timeout 150 python3 -m bench.decode --models $model --warmup 3 --steps 48 --unfused --out "$res" \
      --label "decode_${LABEL}_${model}_unfused" >"$res/decode_${model}_unfused.log" 2>&1
  done
) &
wait
tail -n 2 "$res/gpu_tests.log" "$res/runtime_ab.log"; tail -n 22 "$res"/decode_*.log | cut -c1-200
tar czf "$OUT/runtime_decode.tgz" -C "$res" .
