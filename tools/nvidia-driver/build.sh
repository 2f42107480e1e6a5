#!/usr/bin/env bash
# Builds NVIDIA's DRA driver kubelet plugin (gpu-kubelet-plugin, the module pinned in go.mod,
# fetched through the Go module proxy) into a cache folder outside the repo, for the
# differential tests and the side-by-side benchmark only. Prints the binary's path on the last
# line of stdout. Warm cache: returns at once. Cold: many minutes on 2 cores (cgo, k8s.io/kubernetes).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

module=sigs.k8s.io/dra-driver-nvidia-gpu
version=$(awk -v m="$module" '$1==m && $2 ~ /^v/ {print $2; exit} $1=="require" && $2==m {print $3; exit}' go.mod)
cache_root=${FLEXGPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flexgpu}
# Only the module pins decide what gets built, so they alone make the cache key.
key=$(cat go.mod go.sum | sha256sum | cut -c1-12)
out="$cache_root/nvidia-driver-$version-$key"
bin=gpu-kubelet-plugin

if [ -f "$out/.complete" ]; then
  echo "$out/$bin"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "error: the Go toolchain (go 1.26+) and a C compiler are needed to build NVIDIA's kubelet plugin." >&2
  exit 2
fi

log() { printf '[nvidia-driver %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# A second build started while one runs would only compete for the same two cores.
mkdir -p "$cache_root"
exec 9>"$cache_root/nvidia-driver.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "$out/$bin"
  exit 0
fi

mkdir -p "$out.tmp"
log "building $module $version into $out"
# The module requires k8s.io/kubernetes v1.36.0-rc.0, which the public checksum database does
# not list; go.sum here is pinned instead, so the checksum database is not asked.
export GOSUMDB=off GOFLAGS=-mod=readonly
if ! go mod download >&2; then
  echo "error: downloading Go modules failed; check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY))." >&2
  exit 2
fi
start=$(date +%s)
# cgo: go-nvml loads libnvidia-ml.so.1 with dlopen at run time; nothing links against it here.
CGO_ENABLED=1 CGO_CFLAGS="-O2 -Wno-deprecated-declarations" go build -trimpath -ldflags "-s -w" -o "$out.tmp/$bin" "$module/cmd/$bin" >&2
log "built $bin in $(( $(date +%s) - start ))s"
touch "$out.tmp/.complete"
rm -rf "$out"
mv "$out.tmp" "$out"
# Keep this build and the one before it; drop older ones.
ls -dt "$cache_root"/nvidia-driver-*/ 2>/dev/null | tail -n +3 | xargs -r rm -rf
echo "$out/$bin"
