#!/usr/bin/env bash
# Builds the upstream reference DRA driver's kubelet plugin (the module pinned in go.mod,
# fetched through the Go module proxy) into a cache folder outside the repo, for the
# side-by-side benchmarks and the node test that deploys it by its chart (its image:
# tools/images/example_driver.py). Prints the binary's path on the last line of stdout
# (tools/buildcache.sh). Warm cache: returns at once. Cold: a few minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
. ../buildcache.sh

module=sigs.k8s.io/dra-example-driver
version=$(awk -v m="$module" '$1==m && $2 ~ /^v/ {print $2; exit} $1=="require" && $2==m {print $3; exit}' go.mod)
bin=dra-example-kubeletplugin
# Only the module pins decide what gets built, so they alone make the cache key.
key=$(bc_key go.mod go.sum)
bc_begin "example-driver-$version" "$key" "$bin" "example-driver-*"
bc_need go "install Go 1.26+ (benchmarks, node test)"

bc_log "building $module $version into $BC_OUT"
bc_go_download
start=$(date +%s)
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$BC_TMP/$bin" "$module/cmd/$bin" >&2
bc_log "built $bin in $(( $(date +%s) - start ))s"
bc_finish
