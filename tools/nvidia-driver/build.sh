#!/usr/bin/env bash
# Builds NVIDIA's DRA driver kubelet plugin (gpu-kubelet-plugin, the module pinned in go.mod,
# fetched through the Go module proxy) into a cache folder outside the repo, for the
# differential tests and the side-by-side benchmark only. Prints the binary's path on the last
# line of stdout (tools/buildcache.sh). Warm cache: returns at once. Cold: many minutes on 2
# cores (cgo, k8s.io/kubernetes).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
. ../buildcache.sh

module=sigs.k8s.io/dra-driver-nvidia-gpu
version=$(awk -v m="$module" '$1==m && $2 ~ /^v/ {print $2; exit} $1=="require" && $2==m {print $3; exit}' go.mod)
bin=gpu-kubelet-plugin
# Only the module pins decide what gets built, so they alone make the cache key.
key=$(bc_key go.mod go.sum)
bc_begin "nvidia-driver-$version" "$key" "$bin" "nvidia-driver-*"
bc_need go "install Go 1.26+ and a C compiler"
bc_need gcc "go-nvml is cgo (apt-get install gcc)"

bc_log "building $module $version into $BC_OUT"
# The module requires k8s.io/kubernetes v1.36.0-rc.0, which the public checksum database does
# not list; go.sum here is pinned instead, so the checksum database is not asked.
export GOSUMDB=off GOFLAGS=-mod=readonly
bc_go_download
start=$(date +%s)
# cgo: go-nvml loads libnvidia-ml.so.1 with dlopen at run time; nothing links against it here.
CGO_ENABLED=1 CGO_CFLAGS="-O2 -Wno-deprecated-declarations" go build -trimpath -ldflags "-s -w" -o "$BC_TMP/$bin" "$module/cmd/$bin" >&2
bc_log "built $bin in $(( $(date +%s) - start ))s"
bc_finish
