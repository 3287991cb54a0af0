#!/usr/bin/env bash
# One device call to validate and measure branch exp/host-launch-cost against main (repo root of the
# branch, after `pip install -e .`). Before the call, on the development machine:
#   mkdir -p .exp/main_ref && for f in attention runtime; do git show main:fasttree/$f.py >.exp/main_ref/$f.py; done
# and carry `.exp`. Steps, one after another (the eager numbers are host-sensitive):
# 1. bench.host_overhead with main's fasttree/attention.py and runtime.py swapped in, then with the branch's;
# 2. bench.kernel --suite paper on the branch (its eager and eager-loop columns against kernel_h200_v15*.md);
# 3. the GPU tests that run the direct-launch paths (tree_attention and the runtime).
# Results to $OUT/host_launch_ab.tgz.
# Usage: LABEL=h200_<commit> bash bench/device/host_launch_ab.sh
set -u
: "${LABEL:?}"
res=/root/host_launch_ab; mkdir -p "$res"
export CUDA_VISIBLE_DEVICES=0
cp fasttree/attention.py fasttree/runtime.py "$res/"
cp .exp/main_ref/attention.py .exp/main_ref/runtime.py fasttree/
timeout 120 python3 -m bench.host_overhead >"$res/host_overhead_main.log" 2>&1
cp "$res/attention.py" "$res/runtime.py" fasttree/
timeout 120 python3 -m bench.host_overhead >"$res/host_overhead_branch.log" 2>&1
timeout 240 python3 -m bench.kernel --suite paper --out "$res" --label "$LABEL" >"$res/kernel.log" 2>&1
timeout 300 python3 -m pytest -q -n 8 -p no:warnings tests/test_launch_cache.py tests/test_gpu.py \
  tests/test_runtime_gpu.py tests/test_runtime.py >"$res/gpu_tests.log" 2>&1
tail -n 3 "$res/gpu_tests.log"; tail -n 8 "$res"/host_overhead_*.log; grep -A20 "^Summary" "$res"/kernel_*.md
tar czf "$OUT/host_launch_ab.tgz" -C "$res" .
