#!/usr/bin/env bash
# Builds karpenter-check (Karpenter's own DRA allocator run on flexgpu's node templates; the
# Karpenter module pinned in go.mod, fetched through the Go module proxy) into a cache folder
# outside the repo, for tests only. Prints the binary's path on the last line of stdout.
# Karpenter v1.15 needs Go 1.26.9 or later: GOTOOLCHAIN (default go1.27.3) fetches it.
# Warm cache: returns at once. Cold: many minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

cache_root=${FLEXGPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flexgpu}
# The module pins and the source decide what gets built, so they make the cache key.
key=$(cat go.mod go.sum main.go | sha256sum | cut -c1-12)
out="$cache_root/karpenter-check-$key"
bin=karpenter-check
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3}

if [ -f "$out/.complete" ]; then
  echo "$out/$bin"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "error: the Go toolchain is needed to build karpenter-check." >&2
  exit 2
fi

log() { printf '[karpenter-check %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
mkdir -p "$cache_root"
exec 9>"$cache_root/karpenter-check.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "$out/$bin"
  exit 0
fi

mkdir -p "$out.tmp"
log "building into $out"
if ! go mod download >&2; then
  echo "error: downloading Go modules failed; check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY))." >&2
  exit 2
fi
start=$(date +%s)
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp/$bin" . >&2
log "built $bin in $(( $(date +%s) - start ))s"
touch "$out.tmp/.complete"
rm -rf "$out"
mv "$out.tmp" "$out"
# Keep this build and the one before it; drop older ones.
ls -dt "$cache_root"/karpenter-check-*/ 2>/dev/null | tail -n +3 | xargs -r rm -rf
echo "$out/$bin"
