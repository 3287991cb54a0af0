#!/usr/bin/env bash
# GPU acceptance of a change, on a CUDA machine, from the repository root after `pip install -e .`
# (on the lent device: `python3 -m pip install -q --no-deps --no-build-isolation -e .`, with skops and
# Optuna from wheels carried in .whl/, see bench/README.md):
#   tests     the gpu-marked tests, in parallel workers; a test still running after TEST_HANG_S
#             (default 150) seconds dumps every thread's stack into the log, and the log ends with
#             the slowest tests
#   compiled  the CPU test files whose kernels run compiled on a GPU (attention, launch cache,
#             runtime, packing, PDL), in parallel workers
#   memcheck  compute-sanitizer memcheck and racecheck of tests/memcheck_sample.py
#   kernel    the paper-suite kernel benchmark (kernel_<gpu>.*)
#   families  the kernel benchmark on the other tree families (kernel_<gpu>_fam.*)
#   crossover the crossover suite against query-separated decode (kernel_<gpu>_crossover.*)
#   heldout   with CANDIDATE='FIELD=VALUE;...' (and SEED, TREES, SHAPES, FAMILIES, FAMILY_PARAMS; CHANGED_ONLY=1 times only
#             the trees it changes): the candidate against the defaults and decode on fresh trees
#             (kernel_<gpu>_heldout.*; several candidates separated by '|' run in turn, the second
#             writing kernel_<gpu>_heldout2.*, ...)
#   suites_ab with CANDIDATE (one): the candidate against the defaults and decode on the crossover and
#             families cases it changes (kernel_<gpu>_crossover_ab.*, kernel_<gpu>_fam_ab.*)
#   fresh     with SEED (and TREES, default 112): today's defaults, the runtime and decode on a fresh draw
#             of every family at the default held-out shapes, 3 instances unless INSTANCES says
#             otherwise (kernel_<gpu>_fresh_<SEED>.*; pick a seed no earlier run used)
#   validate  the export EXPORT (default docs/tune/run_export.json, the README main job's) on the frozen
#             test and the paper suite, both targets, every step (STEPS=K: K evenly spaced steps of each
#             workload): validation_<gpu>_<name of EXPORT>.{json,md} and its traces (.jsonl; TRACES=FILE
#             appends to FILE instead, e.g. the traces of a timed-out run carried back to the device,
#             and resumes where that run stopped; a copy of FILE lands in $OUT)
#   plan      planner host time on this machine's CPU (plan_time_<gpu>-host.*)
#   plan_host the runtime's plan + upload host time per serving step (plan_host_<gpu>.json)
#   decode    the end-to-end decode benchmark (decode_<gpu>.*)
# INSTANCES=N times each of our variants as N independent instances (bench.kernel --instances; default 1).
# <gpu> is h200 or h100 as nvidia-smi names the card (else gpu). Results go to $OUT (default
# gpu-check), to be copied to docs/results/ by hand.
# Usage: OUT=folder bash bench/gpu_check.sh [step ...]   (no argument: tests compiled memcheck kernel families)
# Each step has a time limit; its log goes to $OUT and its last lines to the terminal.
set -u
out=${OUT:-gpu-check}
mkdir -p "$out"
steps=${*:-tests compiled memcheck kernel families}
if [ -z "${FASTTREE_GIT_COMMIT:-}" ]; then
  echo "note: FASTTREE_GIT_COMMIT is unset: reports record git rev-parse HEAD (stale on a copied checkout)"
fi
workers=${WORKERS:-8}
inst=(--instances "${INSTANCES:-1}")
case $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) in
  *H200*) gpu=h200 ;;
  *H100*) gpu=h100 ;;
  *) gpu=gpu ;;
esac
for step in $steps; do
  case $step in
    tests)
      timeout "${TESTS_S:-540}" python3 -m pytest -q -n "$workers" -p no:cacheprovider -m gpu --durations=25 \
        -o faulthandler_timeout="${TEST_HANG_S:-150}" tests >"$out/gpu_tests_marked.log" 2>&1
      echo "gpu-marked tests: exit $?"; grep -E "(passed|failed)" "$out/gpu_tests_marked.log" | tail -n 3
      ;;
    compiled)
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
      timeout "${KERNEL_S:-300}" python3 -m bench.kernel "${inst[@]}" --suite paper --out "$out" --label "$gpu" --overwrite \
        >"$out/kernel.log" 2>&1
      echo "kernel benchmark: exit $?"; grep -A8 "^Summary" "$out/kernel_$gpu.md"
      ;;
    families)
      timeout "${KERNEL_S:-300}" python3 -m bench.kernel "${inst[@]}" --suite families --out "$out" --label "${gpu}_fam" \
        --overwrite >"$out/kernel_families.log" 2>&1
      echo "families benchmark: exit $?"; grep -A8 "^Summary" "$out/kernel_${gpu}_fam.md"
      ;;
    crossover)
      timeout "${KERNEL_S:-300}" python3 -m bench.kernel "${inst[@]}" --suite crossover --variants fasttree,query_separated,runtime \
        --export none --out "$out" --label "${gpu}_crossover" --overwrite >"$out/kernel_crossover.log" 2>&1
      echo "crossover benchmark: exit $?"; grep -A14 "^Summary" "$out/kernel_${gpu}_crossover.md"
      ;;
    heldout)
      if [ -z "${CANDIDATE:-}" ]; then echo "heldout needs CANDIDATE='FIELD=VALUE;...'"; exit 2; fi
      shapes=()
      [ -n "${SHAPES:-}" ] && shapes=(--shapes "$SHAPES")
      [ -n "${FAMILIES:-}" ] && shapes+=(--families "$FAMILIES")
      [ -n "${FAMILY_PARAMS:-}" ] && shapes+=(--family-params "$FAMILY_PARAMS")
      [ -n "${CHANGED_ONLY:-}" ] && shapes+=(--changed-only)
      # several candidates separated by '|' run one after the other: kernel_<gpu>_heldout, _heldout2, ...
      IFS='|' read -r -a candidates <<<"$CANDIDATE"
      n=0
      for candidate in "${candidates[@]}"; do
        n=$((n + 1)); label="${gpu}_heldout"; [ "$n" -gt 1 ] && label="${gpu}_heldout$n"
        timeout "${KERNEL_S:-300}" python3 -m bench.kernel "${inst[@]}" --suite heldout --seed "${SEED:-9000}" --trees "${TREES:-56}" \
          "${shapes[@]}" --candidate "$candidate" --variants fasttree,query_separated --export none --out "$out" \
          --label "$label" --overwrite >"$out/kernel_$label.log" 2>&1
        echo "heldout A/B of $candidate: exit $?"; grep -E "^- (candidate_|all_correct)" "$out/kernel_$label.md"
      done
      ;;
    suites_ab)
      if [ -z "${CANDIDATE:-}" ]; then echo "suites_ab needs CANDIDATE='FIELD=VALUE;...'"; exit 2; fi
      for suite in crossover families; do
        label="${gpu}_${suite/families/fam}_ab"
        timeout "${KERNEL_S:-300}" python3 -m bench.kernel "${inst[@]}" --suite "$suite" --candidate "$CANDIDATE" --changed-only \
          --variants fasttree,query_separated --export none --out "$out" --label "$label" --overwrite \
          >"$out/kernel_$label.log" 2>&1
        echo "$suite A/B of $CANDIDATE: exit $?"; grep -E "^- (candidate_|all_correct)" "$out/kernel_$label.md"
      done
      ;;
    fresh)
      if [ -z "${SEED:-}" ]; then echo "fresh needs SEED (a seed no earlier run used)"; exit 2; fi
      label="${gpu}_fresh_$SEED"
      timeout "${KERNEL_S:-300}" python3 -m bench.kernel --instances "${INSTANCES:-3}" --suite heldout --seed "$SEED" \
        --trees "${TREES:-112}" --variants fasttree,query_separated,runtime --export none --out "$out" --label "$label" \
        --overwrite >"$out/kernel_$label.log" 2>&1
      echo "fresh draw $SEED: exit $?"; grep -E "^- (runtime_vs|fasttree_vs|all_correct)" "$out/kernel_$label.md"
      ;;
    validate)
      export_file=${EXPORT:-docs/tune/run_export.json}
      name=$(basename "$export_file" .json)
      steps=()
      [ -n "${STEPS:-}" ] && steps=(--steps "$STEPS")
      timeout "${VALIDATE_S:-540}" python3 -m fasttree.cli validate --config "$export_file" fasttree/toolkit/data/workloads_test \
        fasttree/toolkit/data/workloads/paper_suite.jsonl.gz "${steps[@]}" \
        --traces-out "${TRACES:-$out/validation_${gpu}_${name}.jsonl}" -o "$out/validation_${gpu}_${name}.json" \
        --markdown "$out/validation_${gpu}_${name}.md" --overwrite >"$out/validate_$name.log" 2>&1
      echo "validate $export_file: exit $?"; head -n 7 "$out/validation_${gpu}_${name}.md"
      [ -n "${TRACES:-}" ] && cp "$TRACES" "$out/validation_${gpu}_${name}.jsonl"
      ;;
    plan_host)
      timeout "${PLAN_S:-180}" python3 -m bench.plan_host --json "$out/plan_host_$gpu.json" >"$out/plan_host.log" 2>&1
      echo "plan_host: exit $?"; tail -n 12 "$out/plan_host.log"
      ;;
    plan)
      timeout "${PLAN_S:-180}" python3 -m bench.plan_time --label "$gpu-host" --out "$out" >"$out/plan_time.log" 2>&1
      echo "plan_time: exit $?"; grep -E "^- (max|median|rows)" "$out/plan_time_$gpu-host.md"
      ;;
    decode)
      timeout "${DECODE_S:-400}" python3 -m bench.decode --out "$out" --label "decode_$gpu" >"$out/decode.log" 2>&1
      echo "decode benchmark: exit $?"; tail -n 3 "$out/decode.log"
      ;;
    *) echo "unknown step $step (tests, compiled, memcheck, kernel, families, crossover, heldout, suites_ab, fresh, validate, plan, plan_host, decode)"; exit 2 ;;
  esac
done
