#!/usr/bin/env bash
# A/B of packing's subtree-aligned blocks (fasttree.packing:_ALIGNED_BLOCKS) in one device call
# (repo root, after `pip install -e .`): single calls on the plans it changes (switch_ab.py, 3 rounds),
# then the end-to-end decode benchmark for llama and mistral with the switch off and on (the four
# backends each, so every run has its own query-separated baseline). Results: $OUT/blocks_ab.tgz and
# the A/B's JSON. Usage: bash bench/device/subtree_blocks_ab.sh
set -u
res=/root/blocks_ab; mkdir -p "$res"
timeout 200 python3 bench/device/switch_ab.py --switch fasttree.packing:_ALIGNED_BLOCKS --values false,true \
  --rounds 3 --out "$OUT/subtree_blocks_ab.json" >"$res/switch_ab.log" 2>&1
tail -n 12 "$res/switch_ab.log"
for arm in false true; do
  for model in llama mistral; do
    timeout 100 python3 bench/device/with_switch.py fasttree.packing:_ALIGNED_BLOCKS $arm bench.decode \
      --models $model --backends fasttree,fasttree_overlap,query_separated,query_separated_overlap \
      --warmup 3 --steps 48 --out "$res" --label "decode_blocks_${arm}_$model" >"$res/decode_${arm}_$model.log" 2>&1
    grep -E "^\| $model" "$res/decode_blocks_${arm}_$model.md" | cut -c1-120
  done
done
tar czf "$OUT/blocks_ab.tgz" -C "$res" .
