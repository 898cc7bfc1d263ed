#!/usr/bin/env bash
# Prepares, on a machine that reaches Debian's registry, the one folder a GPU host without
# a network needs for scripts/gpu-check.sh: the headers and libraries frugal builds against
# (Debian's -dev packages, unpacked: the GPU host needs no dpkg) and Fashion-MNIST.
#   scripts/fetch-gpu-deps.sh [DIR]   (default: .gpu-deps, ignored by git; about 35 MB)
set -euo pipefail
dir=${1:-.gpu-deps}
data=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
packages=(libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libgloo-dev
          zlib1g-dev zlib1g)
[ -f "$data/t10k-images-idx3-ubyte.gz" ] ||
  { echo "fetch-gpu-deps: no Fashion-MNIST in '$data' (scripts/setup.sh installs it)" >&2; exit 2; }
rm -rf "$dir"
mkdir -p "$dir/debs" "$dir/prefix" "$dir/fashion-mnist"
echo "fetch-gpu-deps: downloading ${packages[*]}"
(cd "$dir/debs" && apt-get download -q "${packages[@]}")
for deb in "$dir"/debs/*.deb; do
  dpkg -x "$deb" "$dir/prefix"
done
rm -rf "$dir/debs" "$dir/prefix/usr/share/doc" "$dir/prefix/usr/share/man"
# Links into / (libz.so -> /lib/x86_64-linux-gnu/libz.so.1...) made relative to the copy.
while IFS= read -r link; do
  target="$dir/prefix$(readlink "$link")"
  [ -e "$target" ] && ln -sfr "$target" "$link"
done < <(find "$dir/prefix" -type l -lname '/*')
cp "$data"/*.gz "$dir/fashion-mnist/"
echo "fetch-gpu-deps: $(du -sh "$dir" | cut -f1) in $dir"
