#!/usr/bin/env bash
# Builds frugal against the LibTorch inside this machine's `python3 -c 'import torch'`
# and runs the whole suite, the `gpu` label included; then prints a short summary.
# Needs python3 with torch, CMake, ninja and nvcc, and no network: the Debian -dev
# packages come as .deb files in DEPS_DIR (see scripts/fetch-gpu-deps.sh), unpacked with
# dpkg -x into a private prefix, never into /.
#   scripts/gpu-check.sh [DEPS_DIR]   (default: .gpu-deps)
set -euo pipefail
cd "$(dirname "$0")/.."
deps=${1:-.gpu-deps}
work=${FRUGAL_GPU_WORK:-/tmp/frugal-gpu}
prefix=$work/deps
build=$work/build
python=${PYTHON:-python3}
jobs=$(nproc)
start=$(date +%s)

[ -d "$deps" ] && ls "$deps"/*.deb >/dev/null 2>&1 ||
  { echo "gpu-check: no .deb files in '$deps' (run scripts/fetch-gpu-deps.sh)" >&2; exit 2; }
"$python" -c 'import torch' ||
  { echo "gpu-check: '$python' cannot import torch" >&2; exit 2; }

echo "gpu-check: unpacking $(ls "$deps"/*.deb | wc -l) packages into $prefix"
rm -rf "$prefix"
mkdir -p "$prefix"
for deb in "$deps"/*.deb; do
  dpkg -x "$deb" "$prefix"
done
# Development symlinks that point into / (libz.so -> /lib/...) are pointed at the copy.
for link in $(find "$prefix" -type l -lname '/*'); do
  target="$prefix$(readlink "$link")"
  [ -e "$target" ] && ln -sf "$target" "$link"
done
multiarch=$(find "$prefix/usr/lib" -maxdepth 1 -type d -name '*-linux-gnu' | head -n 1)

"$python" - <<'PY'
import torch
print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}, "
      f"device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
PY

echo "gpu-check: configuring in $build"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DFRUGAL_PYTHON="$(command -v "$python")" -DFRUGAL_BUILD_BENCHMARKS=OFF \
  -DCMAKE_PREFIX_PATH="$prefix/usr;$multiarch" -DZLIB_ROOT="$prefix/usr" \
  > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
grep -E '^-- frugal:' "$work/configure.log" || true
echo "gpu-check: building with $jobs jobs"
cmake --build "$build" -j "$jobs"
built=$(date +%s)

echo "gpu-check: running the suite (labels cpu, gpu, install)"
set +e
ctest --test-dir "$build" --output-on-failure -j 4 2>&1 | tee "$work/ctest.log"
status=${PIPESTATUS[0]}
set -e
gpu_run=$(ctest --test-dir "$build" -L gpu -N | tail -n 1)
skipped=$(grep -c '\*\*\*Skipped' "$work/ctest.log" || true)
echo "gpu-check summary: build $((built - start)) s, tests $(( $(date +%s) - built )) s;" \
     "$(grep -E 'tests passed' "$work/ctest.log" | tail -n 1);" \
     "gpu label: ${gpu_run#Total }; skipped: $skipped"
exit "$status"
