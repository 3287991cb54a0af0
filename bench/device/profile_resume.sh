#!/usr/bin/env bash
# Device-side profiling that continues across calls on one warm machine (run from the repo root).
# Usage: bench/device/profile_resume.sh BUDGET SPEC...   SPEC = GPUS:SPLIT:SEED:NAME, e.g. 0,1:train:5:run5 (one
# design on both GPUs: its worker processes split the trees). Never give two SPECs the same SEED and SPLIT.
# FASTTREE_PROFILE_ARGS (e.g. --runtime) is passed on to every `fasttree-tune profile`.
# The trace files live in /root/fasttree_traces/ (kept while the machine stays warm, as is Triton's kernel
# cache), so the same command in the next call resumes each design where it stopped and reuses the compiled
# kernels. Each call ends by copying gzipped snapshots of the files and the logs to $OUT.
set -u
budget=$1; shift
keep=/root/fasttree_traces
mkdir -p "$keep"
pids=()
for spec in "$@"; do
  IFS=: read -r gpu split seed name <<<"$spec"
  CUDA_VISIBLE_DEVICES=$gpu fasttree-tune profile --out "$keep/$name.jsonl" --budget "$budget" -n 100000 \
    --seed "$seed" --split "$split" --no-progress ${FASTTREE_PROFILE_ARGS:-} >>"$keep/$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for spec in "$@"; do
  IFS=: read -r gpu split seed name <<<"$spec"
  echo "== $name ($split, seed $seed, GPU $gpu)"; tail -n 2 "$keep/$name.log"
  fasttree-tune traces "$keep/$name.jsonl" --skip-invalid | tail -n 4
  gzip -9 -c "$keep/$name.jsonl" >"$OUT/$name.jsonl.gz"
  cp "$keep/$name.log" "$OUT/$name.log"
done
