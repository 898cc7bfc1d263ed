#!/usr/bin/env bash
# Installs what frugal needs on Debian 12, and nothing that is there already.
#   scripts/setup.sh [demo|torch2|debian|sanitize|all]   (default: all)
# demo:   what `make demo` needs and no more: the compiler, CMake, Ninja, the library's and
#         the examples' headers, Fashion-MNIST, and the torch wheel (LibTorch 2.x) in a
#         virtual environment outside the repository ($FRUGAL_VENV, default
#         ~/.cache/frugal/venv).
# torch2: what demo installs, and what the suite compares against and uses: GoogleTest,
#         Google Benchmark, fortunes, Chromium (the timeline page), matplotlib (the plots), and
#         transformers, peft, safetensors and bitsandbytes in the same venv.
# debian: LibTorch 1.13 from Debian's libtorch-dev, with OpenBLAS for its BLAS calls.
# sanitize: what debian needs (the sanitizer build uses LibTorch 1.13; GCC brings ASan).
set -euo pipefail

which_builds=${1:-all}
venv=${FRUGAL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/frugal/venv}
torch_version=${FRUGAL_TORCH_VERSION:-2.15.0}
# The references the fine-tuning twin compares against, in the same venv.
references=(transformers==5.25.0 peft==0.21.2 safetensors==0.8.0 bitsandbytes==0.50.2)

say() { printf 'setup: %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

packages=(cmake ninja-build g++ make ccache python3 zlib1g-dev libfmt-dev libcli11-dev
          nlohmann-json3-dev libgloo-dev dataset-fashion-mnist)
suite=(libgtest-dev libgmock-dev libbenchmark-dev fortunes chromium)
case "$which_builds" in
  demo) ;;
  torch2) packages+=("${suite[@]}") ;;
  debian|sanitize|all) packages+=("${suite[@]}" libtorch-dev libopenblas0-pthread) ;;
  *) echo "setup: unknown build '$which_builds' (demo, torch2, debian, sanitize or all)" >&2
     exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
else
  say "Debian packages: all ${#packages[@]} present"
fi

if [ "$which_builds" = debian ] || [ "$which_builds" = sanitize ]; then
  exit 0
fi
if "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  say "torch $torch_version present in $venv"
else
  if ! python3 -m venv --help >/dev/null 2>&1; then
    say "installing python3-venv"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv
  fi
  say "installing torch==$torch_version into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==$torch_version"
fi
if [ "$which_builds" = demo ]; then
  exit 0
fi
if "$venv/bin/python" -c "import matplotlib" 2>/dev/null; then
  say "matplotlib present in $venv"
else
  say "installing matplotlib (for scripts/plot_report.py) into $venv"
  "$venv/bin/pip" install -q --disable-pip-version-check matplotlib
fi
if "$venv/bin/python" -c "import transformers, peft, safetensors, bitsandbytes" 2>/dev/null; then
  say "transformers, peft, safetensors and bitsandbytes present in $venv"
else
  say "installing ${references[*]} into $venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "${references[@]}"
fi
