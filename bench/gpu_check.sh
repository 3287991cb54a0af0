#!/usr/bin/env bash
# GPU acceptance of a change, on a CUDA machine, from the repository root after `pip install -e .`:
#   tests     the gpu-marked tests, then the CPU test files whose kernels run compiled on a GPU
#             (attention, launch cache, runtime, packing), in parallel workers
#   memcheck  compute-sanitizer memcheck and racecheck of tests/memcheck_sample.py
#   kernel    the paper-suite kernel benchmark (docs/results/kernel_h200.*)
#   families  the kernel benchmark on the other tree families (docs/results/kernel_h200_fam.*)
# Usage: OUT=folder bash bench/gpu_check.sh [tests] [memcheck] [kernel] [families]   (no argument: all four)
# Each step has a time limit; its log goes to $OUT and its last lines to the terminal.
set -u
out=${OUT:-gpu-check}
mkdir -p "$out"
steps=${*:-tests memcheck kernel families}
workers=${WORKERS:-8}
for step in $steps; do
  case $step in
    tests)
      timeout "${TESTS_S:-300}" python3 -m pytest -q -n "$workers" -p no:cacheprovider -m gpu tests \
        >"$out/gpu_tests_marked.log" 2>&1
      echo "gpu-marked tests: exit $?"; tail -n 3 "$out/gpu_tests_marked.log"
      timeout "${TESTS_S:-300}" python3 -m pytest -q -n "$workers" -p no:cacheprovider tests/test_attention.py \
        tests/test_launch_cache.py tests/test_runtime.py tests/test_packing.py tests/test_pdl.py \
        >"$out/gpu_tests_compiled.log" 2>&1
      echo "compiled CPU test files: exit $?"; tail -n 3 "$out/gpu_tests_compiled.log"
      ;;
    memcheck)
      for tool in memcheck racecheck; do
        # memcheck: every tensor its own cudaMalloc, so a write past one is caught (not absorbed by a
        # neighbour in the caching allocator's segment); torch reads the variable's presence, so it is
        # set for memcheck only
        uncached=()
        [ "$tool" = memcheck ] && uncached=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)
        "${uncached[@]}" timeout "${SANITIZER_S:-240}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
          python3 tests/memcheck_sample.py >"$out/$tool.log" 2>&1
        echo "$tool: exit $?"; tail -n 2 "$out/$tool.log"
      done
      ;;
    kernel)
      timeout "${KERNEL_S:-300}" python3 -m bench.kernel --suite paper --out "$out" --label h200 --overwrite \
        >"$out/kernel.log" 2>&1
      echo "kernel benchmark: exit $?"; grep -A8 "^Summary" "$out"/kernel_h200.md
      ;;
    families)
      timeout "${KERNEL_S:-300}" python3 -m bench.kernel --suite families --out "$out" --label h200_fam \
        --overwrite >"$out/kernel_families.log" 2>&1
      echo "families benchmark: exit $?"; grep -A8 "^Summary" "$out"/kernel_h200_fam.md
      ;;
    *) echo "unknown step $step (tests, memcheck, kernel, families)"; exit 2 ;;
  esac
done
