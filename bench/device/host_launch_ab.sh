#!/usr/bin/env bash
# One device call (x2 host) to validate and measure branch exp/host-launch-cost against main
# (repo root of the branch, after `pip install -e .`; main's tree is rebuilt from git in /root/main_ref).
# GPU 1: the GPU tests that run the direct-launch paths (tree_attention and the runtime).
# GPU 0: bench.host_overhead on main and on the branch, then bench.kernel --suite paper on the branch
# (its eager and eager-loop columns against kernel_h200_v15*.md). Results to $OUT/host_launch_ab.tgz.
# Usage: LABEL=h200_<commit> bash bench/device/host_launch_ab.sh
set -u
: "${LABEL:?}"
res=/root/host_launch_ab; mkdir -p "$res"
rm -rf /root/main_ref && git worktree add -f /root/main_ref main >/dev/null 2>&1 || cp -r . /root/main_ref
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 300 python3 -m pytest -q -n 8 -p no:warnings tests/test_launch_cache.py tests/test_gpu.py \
    tests/test_runtime_gpu.py tests/test_runtime.py >"$res/gpu_tests.log" 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=0
  (cd /root/main_ref && PYTHONPATH=/root/main_ref timeout 120 python3 -m bench.host_overhead) >"$res/host_overhead_main.log" 2>&1
  timeout 120 python3 -m bench.host_overhead >"$res/host_overhead_branch.log" 2>&1
) &
wait
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m bench.kernel --suite paper --out "$res" --label "$LABEL" >"$res/kernel.log" 2>&1
tail -n 3 "$res/gpu_tests.log"; tail -n 8 "$res"/host_overhead_*.log; grep -A20 "^Summary" "$res"/kernel_*.md
tar czf "$OUT/host_launch_ab.tgz" -C "$res" .
