#!/usr/bin/env bash
# The GPU check, for a machine with a GPU and no network: builds frugal's gpu-labelled tests
# and two examples against the LibTorch of `$PYTHON -c 'import torch'`, runs them on the GPU
# and says what passed. It fails when CUDA is not available, when a gpu test fails or is
# skipped (only the NCCL test may skip, where there are fewer than two GPUs), when fewer gpu
# tests were built than the sources hold, when LibTorch was configured without CUDA, or when
# an example's run on CUDA fails: a check that tested nothing never passes. It ends by its
# deadline whatever hangs.
#   scripts/gpu-check.sh [DEPS_DIR]   (default: .gpu-deps, made by scripts/fetch-gpu-deps.sh)
# Environment: PYTHON (python3), FRUGAL_GPU_WORK (/tmp/frugal-gpu; the build tree there is
# reused by a rerun), OUT (where its four files go: gpu-check.log, summary.json, logs.tar.gz
# with every other log, fashion_mnist-step2.png; $FRUGAL_GPU_WORK/out when unset),
# TORCH_CUDA_ARCH_LIST (9.0: Hopper), JOBS (the cores), FRUGAL_GPU_DEADLINE (seconds for the
# whole check, 480: each stage gets what is left of it, a test at most 120 s).
# FRUGAL_GPU_CHECK_CPU_PARTS=1, where CUDA is not available: goes on all the same (the gpu
# tests then skip, the examples fail) to time the parts a CPU can run, and runs the CPU tests
# of the gpu build; it exits 3 when they pass, 1 when they fail.
# Exit status: 0 passed; 1 a build, test or example failed; 2 a missing input; 3 no CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
source_dir=$(pwd)
deps=${1:-.gpu-deps}
work=${FRUGAL_GPU_WORK:-/tmp/frugal-gpu}
out=${OUT:-$work/out}
build=$work/build
logs=$work/logs  # packed into $out/logs.tar.gz at the end
python=${PYTHON:-python3}
jobs=${JOBS:-$(nproc)}
deadline_s=${FRUGAL_GPU_DEADLINE:-480}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
rm -rf "$logs"
mkdir -p "$out" "$build" "$logs"
rm -f "$out/gpu-check.log" "$out/summary.json" "$out/logs.tar.gz"
t0=$(date +%s)
declare -A seconds=()
stage_start=$t0

say() { printf 'gpu-check: %s\n' "$*" | tee -a "$out/gpu-check.log"; }
lap() { local now; now=$(date +%s); seconds[$1]=$((now - stage_start)); stage_start=$now; }
# Seconds left before the deadline (at least 1: a stage started late fails by its timeout).
left() { local l=$((t0 + deadline_s - $(date +%s))); echo $((l > 0 ? l : 1)); }
# Runs a command within what is left of the deadline; status 124 when the deadline ended it.
bounded() { timeout --kill-after=10 "$(left)" "$@"; }

# summary.json: the outcome, why, each stage's seconds and the tests' and examples' results.
finish() {
  local status=$1 reason=$2
  lap "${3:-end}"
  {
    printf '{"status": "%s", "reason": "%s", "total_s": %d' "$status" "${reason//\"/\'}" \
      $(($(date +%s) - t0))
    for k in "${!seconds[@]}"; do printf ', "%s_s": %d' "$k" "${seconds[$k]}"; done
    [ -f "$logs/torch.json" ] && printf ', "torch": %s' "$(cat "$logs/torch.json")"
    [ -f "$logs/tests.json" ] && printf ', "tests": %s' "$(cat "$logs/tests.json")"
    [ -f "$logs/examples.json" ] && printf ', "examples": %s' "$(cat "$logs/examples.json")"
    printf '}\n'
  } > "$out/summary.json"
  # At most four files come back from a loaned machine: this log, summary.json, the other
  # logs packed in one, and the example's memory timeline.
  tar -czf "$out/logs.tar.gz" -C "$logs" . 2> /dev/null
  say "$status: $reason ($(($(date +%s) - t0)) s; summary.json, gpu-check.log and logs.tar.gz in $out)"
  case $status in
    passed) exit 0 ;;
    "no cuda") exit 3 ;;
    "missing input") exit 2 ;;
    *) exit 1 ;;
  esac
}

[ -d "$deps/prefix/usr/include" ] && [ -f "$deps/fashion-mnist/t10k-images-idx3-ubyte.gz" ] ||
  finish "missing input" "no prepared '$deps' (run scripts/fetch-gpu-deps.sh where Debian's registry is reachable)" inputs
deps=$(cd "$deps" && pwd)
command -v nvcc > /dev/null ||
  finish "missing input" "no nvcc on PATH (LibTorch's CMake needs the CUDA toolkit of the wheel's CUDA)" inputs
say "nvcc: $(nvcc --version | grep -o 'release [0-9.]*' | head -n 1)"
"$python" - > "$logs/torch.json" 2> "$logs/torch.log" <<'PY' ||
import json, torch
available = torch.cuda.is_available()
print(json.dumps({"version": torch.__version__, "cuda": torch.version.cuda,
                  "available": available, "devices": torch.cuda.device_count() if available else 0,
                  "device": torch.cuda.get_device_name(0) if available else None}))
PY
  { rm -f "$logs/torch.json"; finish "missing input" "'$python' cannot import torch (see torch.log)" probe; }
say "torch: $(cat "$logs/torch.json")"
no_cuda="CUDA is not available to '$python' (torch.cuda.is_available() is False)"
if ! grep -q '"available": true' "$logs/torch.json"; then
  [ "${FRUGAL_GPU_CHECK_CPU_PARTS:-0}" = 1 ] || finish "no cuda" "$no_cuda: nothing was tested" probe
  say "$no_cuda; going on to time the CPU's parts (FRUGAL_GPU_CHECK_CPU_PARTS=1)"
  cpu_parts=true
  deadline_s=${FRUGAL_GPU_DEADLINE:-1800}  # a CPU's few cores build slowly
fi
lap probe

multiarch=$(find "$deps/prefix/usr/lib" -maxdepth 1 -type d -name '*-linux-gnu' | head -n 1)
say "configuring in $build"
bounded cmake -S "$source_dir" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DFRUGAL_PYTHON="$(command -v "$python")" -DFRUGAL_GPU_CHECK=ON -DFRUGAL_WERROR=OFF \
  -DFRUGAL_BUILD_BENCHMARKS=OFF -DCMAKE_PREFIX_PATH="$deps/prefix/usr;$multiarch" \
  -DZLIB_ROOT="$deps/prefix/usr" > "$logs/configure.log" 2>&1 ||
  finish failed "cmake's configure failed (configure.log)" configure
grep -E '^-- frugal:' "$logs/configure.log" | tee -a "$out/gpu-check.log"
grep -q 'CUDA: ON' "$logs/configure.log" ||
  finish failed "LibTorch was configured without CUDA (configure.log): the CUDA paths would not be built" configure
lap configure

say "building frugal_gpu_tests, memory_tour and fashion_mnist with $jobs jobs"
bounded cmake --build "$build" -j "$jobs" --target frugal_gpu_tests memory_tour fashion_mnist \
  > "$logs/build.log" 2>&1 || { tail -n 30 "$logs/build.log"; finish failed "the build failed or ran past the deadline (build.log)" build; }
lap build

# The gpu tests the sources hold (TEST/TEST_F/TEST_P of a Cuda suite) against those built,
# a parameterised one counted once.
expected=$(cat "$source_dir"/tests/*.cpp | grep -cE '^TEST(_F|_P)?\(Cuda')
built=$("$build/tests/frugal_gpu_tests" --gtest_list_tests --gtest_filter='Cuda*' 2> /dev/null |
  awk '/^[^ ]/ { suite = $1; sub(/^.*\//, "", suite); next }
       /^  / { name = $1; sub(/\/.*$/, "", name); print suite name }' | sort -u | wc -l)
# Each instance of a parameterised test is a ctest test of its own: all must have an outcome.
instances=$("$build/tests/frugal_gpu_tests" --gtest_list_tests --gtest_filter='Cuda*' 2> /dev/null |
  grep -c '^  ')
say "gpu tests: $expected in the sources, $built built ($instances with each parameter)"
[ "$built" -eq "$expected" ] ||
  finish failed "$built gpu tests were built, the sources hold $expected (tests/CMakeLists.txt's FRUGAL_GPU_CHECK list)" count

# The tests share the one GPU: a few at a time where there are cores for it.
test_jobs=$((jobs >= 8 ? 4 : 2))
say "running the gpu tests (ctest -L gpu --timeout 120 -j $test_jobs, $(left) s left)"
# The examples keep 90 s of the deadline.
timeout --kill-after=10 $(($(left) > 120 ? $(left) - 90 : 30)) \
  ctest --test-dir "$build" -L gpu --timeout 120 --output-on-failure -j "$test_jobs" \
  > "$logs/ctest.log" 2>&1
ctest_status=$?
# Each test's outcome: passed, failed or skipped (a skip only the NCCL test may have).
"$python" - "$logs/ctest.log" > "$logs/tests.json" <<'PY'
import json, re, sys
results = {"passed": [], "failed": [], "skipped": []}
for line in open(sys.argv[1], errors="replace"):
    # A parameterised test's name goes on with "  # GetParam() = ..." before the dots.
    m = re.search(r"Test\s+#\d+: (\S+).*? \.{2,}\s*(\*\*\*Skipped|Passed|\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception|Not Run)", line)
    if m:
        kind = {"Passed": "passed", "***Skipped": "skipped"}.get(m.group(2), "failed")
        results[kind].append(m.group(1))
print(json.dumps(results))
PY
lap tests
read -r passed failed skipped bad_skips < <("$python" - "$logs/tests.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
allowed = {"CudaDataParallel.TwoRanksTrainAsOneProcessOverNccl"}
print(len(r["passed"]), len(r["failed"]), len(r["skipped"]),
      ",".join(t for t in r["skipped"] if t not in allowed) or "-")
PY
)
say "gpu tests: $passed passed, $failed failed, $skipped skipped (ctest exit $ctest_status)"
[ $((passed + failed + skipped)) -eq "$instances" ] ||
  finish failed "ctest gave $((passed + failed + skipped)) outcomes for $instances gpu tests (ctest.log)" tests

say "examples on CUDA: memory_tour, fashion_mnist under a memory cap"
examples_ok=true
run_example() {  # name, command...
  local name=$1; shift
  local s; s=$(date +%s)
  if bounded "$@" > "$logs/$name.log" 2>&1; then
    printf '"%s": {"status": "passed", "seconds": %d}' "$name" $(($(date +%s) - s))
  else
    examples_ok=false
    printf '"%s": {"status": "failed", "seconds": %d}' "$name" $(($(date +%s) - s))
  fi
}
{
  printf '{'
  run_example memory_tour "$build/examples/memory_tour" --device cuda --steps 2
  printf ', '
  # 8192 images a step need about 2 GiB of activations; under a 1 GiB cap the run goes on
  # by halving its micro-batch (OomRecovery), the effective batch unchanged. Step 2 is
  # recorded on the device (the caching allocator's trace) and drawn as a PNG.
  run_example fashion_mnist "$build/examples/fashion_mnist" --device cuda \
    --data-dir "$deps/fashion-mnist" --batch 8192 --max-steps 3 --eval-samples 1000 \
    --memory-cap $((1 << 30)) --report "$logs/fashion_mnist.jsonl" --quiet \
    --memory-timeline "$out/fashion_mnist-step2.png"
  printf '}\n'
} > "$logs/examples.json"
lap examples
if $examples_ok && ! "$python" - "$logs/fashion_mnist.jsonl" <<'PY'
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if "oom_retries" in r and "micro_batch" in r]
sys.exit(0 if steps and any(r["micro_batch"] < 8192 for r in steps) else 1)
PY
then
  examples_ok=false
  say "fashion_mnist: no step ran below the batch of 8192 under the 1 GiB cap (fashion_mnist.jsonl)"
fi
if $examples_ok && ! [ -s "$out/fashion_mnist-step2.png" ]; then
  examples_ok=false
  say "fashion_mnist: the CUDA memory timeline of step 2 was not written (fashion_mnist.log)"
fi

if [ -n "${cpu_parts:-}" ]; then
  # The CPU tests of the gpu build's test files, against this LibTorch.
  bounded "$build/tests/frugal_gpu_tests" --gtest_filter='-Cuda*' > "$logs/cpu-tests.log" 2>&1 ||
    finish failed "the CPU tests of frugal_gpu_tests failed (cpu-tests.log)" cpu_tests
  say "CPU tests of the gpu build: $(grep -o '\[  PASSED  \] [0-9]* tests' "$logs/cpu-tests.log")"
  finish "no cuda" "$no_cuda: the CPU's parts were timed and their CPU tests passed, nothing was tested on a GPU" cpu_tests
fi
[ "$failed" -eq 0 ] && [ "$ctest_status" -eq 0 ] || finish failed "$failed gpu test(s) failed (ctest.log)"
[ "$passed" -gt 0 ] || finish failed "no gpu test ran (ctest.log)"
[ "$bad_skips" = "-" ] || finish failed "gpu tests were skipped on a GPU: $bad_skips (ctest.log)"
$examples_ok || finish failed "an example failed on CUDA (examples.json and its log)"
finish passed "$passed gpu tests passed ($skipped skipped of those allowed to), both examples ran on CUDA"
