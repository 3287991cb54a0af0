#!/usr/bin/env bash
# Device-side driver for one profiling call on a machine with one or more GPUs (run from the repo root).
# Usage: bench/device/profile_pair.sh BUDGET SPEC...   where SPEC is GPU:SPLIT:SEED:NAME, e.g. 0:train:1:run1
# Each SPEC runs `fasttree-tune profile` on its GPU into $OUT/NAME.jsonl; all run concurrently. Afterwards each
# file is summarised with `fasttree-tune traces` and gzipped (finished trace sets are .jsonl.gz).
set -u
budget=$1; shift
pids=()
for spec in "$@"; do
  IFS=: read -r gpu split seed name <<<"$spec"
  CUDA_VISIBLE_DEVICES=$gpu fasttree-tune profile --out "$OUT/$name.jsonl" --budget "$budget" -n 100000 \
    --seed "$seed" --split "$split" --no-progress >"$OUT/$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for spec in "$@"; do
  IFS=: read -r gpu split seed name <<<"$spec"
  echo "== $name ($split, seed $seed, GPU $gpu)"; tail -n 6 "$OUT/$name.log"
  fasttree-tune traces "$OUT/$name.jsonl" --skip-invalid
  gzip -9 "$OUT/$name.jsonl"
done
