#!/usr/bin/env bash
# Builds the upstream reference DRA driver's kubelet plugin (the module pinned in go.mod,
# fetched through the Go module proxy) into a cache folder outside the repo, for the
# side-by-side benchmarks and the node test that deploys it by its chart (its image:
# tools/images/example_driver.py). Prints the binary's path on the last line of stdout.
# Warm cache: returns at once. Cold: a few minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

module=sigs.k8s.io/dra-example-driver
version=$(awk -v m="$module" '$1==m && $2 ~ /^v/ {print $2; exit} $1=="require" && $2==m {print $3; exit}' go.mod)
cache_root=${FLEXGPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flexgpu}
# Only the module pins decide what gets built, so they alone make the cache key.
key=$(cat go.mod go.sum | sha256sum | cut -c1-12)
out="$cache_root/example-driver-$version-$key"
bin=dra-example-kubeletplugin

if [ -f "$out/.complete" ]; then
  echo "$out/$bin"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "error: the Go toolchain (go 1.26+) is needed to build the reference driver (benchmarks, node test)." >&2
  exit 2
fi

log() { printf '[example-driver %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# A second build started while one runs would only compete for the same two cores.
mkdir -p "$cache_root"
exec 9>"$cache_root/example-driver.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "$out/$bin"
  exit 0
fi

mkdir -p "$out.tmp"
log "building $module $version into $out"
if ! go mod download >&2; then
  echo "error: downloading Go modules failed; check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY))." >&2
  exit 2
fi
start=$(date +%s)
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp/$bin" "$module/cmd/$bin" >&2
log "built $bin in $(( $(date +%s) - start ))s"
touch "$out.tmp/.complete"
rm -rf "$out"
mv "$out.tmp" "$out"
# Keep this build and the one before it; drop older ones.
ls -dt "$cache_root"/example-driver-*/ 2>/dev/null | tail -n +3 | xargs -r rm -rf
echo "$out/$bin"
