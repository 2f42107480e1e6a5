#!/usr/bin/env bash
# Builds one of the Karpenter tools of this module (the Karpenter module pinned in go.mod, fetched
# through the Go module proxy) into a cache folder outside the repo, for tests only:
#   karpenter-check  Karpenter's DRA allocator run on flexgpu's node templates (default)
#   karpenter-kwok   Karpenter with its kwok cloud provider, instance types carrying the templates
# Prints the binary's path on the last line of stdout (karpenter-kwok: Karpenter's CRDs in crds/
# beside it). Karpenter v1.15 needs Go 1.26.9 or later:
# GOTOOLCHAIN (default go1.27.3) fetches it. Warm cache: returns at once. Cold: many minutes on
# 2 cores (karpenter-check about 6, karpenter-kwok more: the whole controller); built with
# `nice -n 19` so that a machine's other work keeps its share.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

bin=${1:-karpenter-check}
case "$bin" in
  karpenter-check|karpenter-kwok) ;;
  *) echo "error: unknown tool '$bin'; allowed: karpenter-check, karpenter-kwok" >&2; exit 2 ;;
esac
cache_root=${FLEXGPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flexgpu}
# The module pins and the source decide what gets built, so they make the cache key.
key=$(cat build.sh go.mod go.sum templates/*.go "cmd/$bin"/*.go | sha256sum | cut -c1-12)
out="$cache_root/$bin-$key"
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3}

if [ -f "$out/.complete" ]; then
  echo "$out/$bin"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "error: the Go toolchain is needed to build $bin." >&2
  exit 2
fi

log() { printf '[%s %s] %s\n' "$bin" "$(date +%H:%M:%S)" "$*" >&2; }
mkdir -p "$cache_root"
exec 9>"$cache_root/$bin.lock"
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
CGO_ENABLED=0 nice -n 19 go build -trimpath -ldflags "-s -w" -o "$out.tmp/$bin" "./cmd/$bin" >&2
log "built $bin in $(( $(date +%s) - start ))s"
if [ "$bin" = karpenter-kwok ]; then
  # Karpenter's CRDs (NodePool, NodeClaim, ...) and the kwok NodeClass, from the same module.
  src=$(go list -m -f '{{.Dir}}' sigs.k8s.io/karpenter)
  mkdir -p "$out.tmp/crds"
  cp "$src"/pkg/apis/crds/*.yaml "$src"/kwok/apis/crds/*.yaml "$out.tmp/crds/"
  chmod u+w "$out.tmp"/crds/*.yaml
fi
touch "$out.tmp/.complete"
rm -rf "$out"
mv "$out.tmp" "$out"
# Keep this build and the one before it; drop older ones.
ls -dt "$cache_root/$bin"-*/ 2>/dev/null | tail -n +3 | xargs -r rm -rf
echo "$out/$bin"
