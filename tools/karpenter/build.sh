#!/usr/bin/env bash
# Builds one of the Karpenter tools of this module (the Karpenter module pinned in go.mod, fetched
# through the Go module proxy) into a cache folder outside the repo, for tests only:
#   karpenter-check  Karpenter's DRA allocator run on flexgpu's node templates (default)
#   karpenter-kwok   Karpenter with its kwok cloud provider, instance types carrying the templates
# Prints the binary's path on the last line of stdout (tools/buildcache.sh; karpenter-kwok:
# Karpenter's CRDs in crds/ beside it). Karpenter v1.15 needs Go 1.26.9 or later:
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
. ../buildcache.sh
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3}
# The module pins and the source decide what gets built, so they make the cache key.
key=$(bc_key build.sh go.mod go.sum templates/*.go "cmd/$bin"/*.go)
bc_begin "$bin" "$key" "$bin"
bc_need go "install Go 1.26+ (GOTOOLCHAIN fetches the release Karpenter needs)"

bc_log "building into $BC_OUT"
bc_go_download
start=$(date +%s)
CGO_ENABLED=0 nice -n 19 go build -trimpath -ldflags "-s -w" -o "$BC_TMP/$bin" "./cmd/$bin" >&2
bc_log "built $bin in $(( $(date +%s) - start ))s"
if [ "$bin" = karpenter-kwok ]; then
  # Karpenter's CRDs (NodePool, NodeClaim, ...) and the kwok NodeClass, from the same module.
  src=$(go list -m -f '{{.Dir}}' sigs.k8s.io/karpenter)
  mkdir -p "$BC_TMP/crds"
  cp "$src"/pkg/apis/crds/*.yaml "$src"/kwok/apis/crds/*.yaml "$BC_TMP/crds/"
  chmod u+w "$BC_TMP"/crds/*.yaml
fi
bc_finish
