#!/usr/bin/env bash
# One device call (single GPU, repo root, after `pip install -e .`): is the polished tuner export
# (docs/tune/polished/export.json, `fasttree-tune run` with the polish) faster on the GPU than the
# committed tuner export and the GPU-refined one? Steps, one after another:
# 1. `fasttree-tune validate` of each export against the defaults on the held-out workloads
#    (traces/workloads_heldout, 4 steps each): measured speedups and the model's predictions;
# 2. the decode benchmark (Llama and Mistral) with the polished export, to set next to
#    docs/bench/decode_h200_f94a221_{tuned,measured}_*.md (run on another host: compare ratios to
#    query_separated, or rerun those two exports in the same call when time allows).
# Results to $OUT/validate_polish.tgz.
# Usage: LABEL=h200_<commit> [PARTS="validate decode"] bash bench/device/validate_polish.sh
set -u
: "${LABEL:?}"
res=/root/validate_polish; mkdir -p "$res"
export CUDA_VISIBLE_DEVICES=0
cli=(python3 -c "import sys; from fasttree.cli import main; sys.exit(main(sys.argv[1:]))")  # an array: timeout cannot run a shell function
PARTS=${PARTS:-validate decode}
if [[ " $PARTS " == *" validate "* ]]; then
for name in tuned polished schema4 measured; do
  case $name in
    tuned) export_path=docs/tune/export.json ;;
    polished) export_path=docs/tune/polished/export.json ;;
    schema4) export_path=docs/tune/schema4/export.json ;;
    measured) export_path=docs/tune/export_measured.json ;;
  esac
  timeout 110 "${cli[@]}" validate --config "$export_path" --steps 4 --model models/h200_latency_model.skops \
    --traces-out "$res/validate_$name.jsonl" --json "$res/validate_$name.json" >"$res/validate_$name.log" 2>&1
  tail -n 2 "$res/validate_$name.log"
done
fi
if [[ " $PARTS " == *" decode "* ]]; then
for model in llama mistral; do
  timeout 150 python3 -m bench.decode --models $model --warmup 3 --steps 48 --export docs/tune/polished/export.json \
    --out "$res" --label "decode_${LABEL}_polished_$model" >"$res/decode_$model.log" 2>&1
done
fi
grep -h "fasttree " "$res"/decode_*.md | cut -c1-120
tar czf "$OUT/validate_polish.tgz" -C "$res" .
