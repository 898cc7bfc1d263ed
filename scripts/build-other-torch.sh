#!/usr/bin/env bash
# Builds frugal with -Werror against another torch wheel than the one `make test` uses: by
# default 2.11.0, the LibTorch of the GPU host that scripts/gpu-check.sh runs on, so that the
# check's build does not meet an error there first. It builds what the check builds (the
# library, frugal_gpu_tests, the examples) and runs the CPU tests of frugal_gpu_tests.
#   scripts/build-other-torch.sh [VERSION]   (by hand; CI installs no third wheel)
# The wheel goes into a venv of its own, ~/.cache/frugal/venv-VERSION ($FRUGAL_OTHER_VENV),
# the build into build/torch-VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.11.0}
venv=${FRUGAL_OTHER_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/frugal/venv-$version}
build=build/torch-$version
if "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" \
    2>/dev/null; then
  echo "build-other-torch: torch $version present in $venv"
else
  echo "build-other-torch: installing torch==$version into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==$version"
fi
start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFRUGAL_PYTHON="$venv/bin/python" \
  -DFRUGAL_GPU_CHECK=ON -DFRUGAL_BUILD_BENCHMARKS=OFF > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
grep -E '^-- frugal:' "$build.configure.log"
cmake --build "$build" -j "${JOBS:-2}" --target frugal_gpu_tests fashion_mnist memory_tour tiny_lm \
  gan distill
built=$(date +%s)
echo "build-other-torch: built against torch $version with -Werror in $((built - start)) s"
"$build/tests/frugal_gpu_tests" --gtest_filter='-Cuda*' --gtest_brief=1
echo "build-other-torch: the CPU tests of frugal_gpu_tests passed on torch $version" \
     "in $(($(date +%s) - built)) s"
