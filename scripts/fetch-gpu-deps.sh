#!/usr/bin/env bash
# Downloads (does not install) the Debian packages that scripts/gpu-check.sh builds against,
# for a GPU machine that has no network. Run it where apt reaches Debian's registry.
#   scripts/fetch-gpu-deps.sh [DIR]   (default: .gpu-deps, ignored by git)
set -euo pipefail
dir=${1:-.gpu-deps}
packages=(libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libgloo-dev
          zlib1g-dev zlib1g)
mkdir -p "$dir"
cd "$dir"
echo "fetch-gpu-deps: downloading ${packages[*]} into $(pwd)"
apt-get download "${packages[@]}"
ls -la
