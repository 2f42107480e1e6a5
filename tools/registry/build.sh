#!/usr/bin/env bash
# Builds the OCI image registry the real-node tests pull the flexgpu image from: CNCF
# distribution's registry (github.com/distribution/distribution/v3, pinned in go.mod) with its
# filesystem storage driver only (cmd/flexgpu-registry), into a cache folder outside the repo.
# Prints that folder on the last line of stdout; a warm cache returns at once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

cache_root=${FLEXGPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flexgpu}
# The key covers everything that changes the program: module pins and our own Go sources.
key=$(cat go.mod go.sum build.sh $(find . -name '*.go' | LC_ALL=C sort) | sha256sum | cut -c1-12)
out="$cache_root/registry-$key"

if [ -f "$out/.complete" ]; then
  echo "$out"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "error: the Go toolchain (go 1.26+) is needed to build the local image registry." >&2
  exit 2
fi

# Two builds of one key at once (several shells or worktrees) would share the .tmp folder: the
# second waits for the first and then finds it done.
mkdir -p "$cache_root"
exec 9>"$out.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "$out"
  exit 0
fi
log() { printf '[registry %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
log "building the image registry (distribution) into $out"
if ! go mod download >&2; then
  echo "error: downloading Go modules failed; check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY))." >&2
  exit 2
fi
rm -rf "$out.tmp"
mkdir -p "$out.tmp"
start=$(date +%s)
# Pure Go: no C compiler, the same program on every Linux.
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp/flexgpu-registry" ./cmd/flexgpu-registry
log "built flexgpu-registry in $(( $(date +%s) - start ))s"
touch "$out.tmp/.complete"
rm -rf "$out"
mv "$out.tmp" "$out"
# Keep this build and the one before it; drop older ones.
ls -dt "$cache_root"/registry-*/ 2>/dev/null | tail -n +3 | xargs -r rm -rf
echo "$out"
