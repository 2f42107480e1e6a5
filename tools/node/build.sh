#!/usr/bin/env bash
# Builds what a real test node runs: the upstream kubelet, containerd with its runc shim and
# ctr, runc (seccomp) and the CNI plugins (bridge, host-local, loopback), each from the module
# pinned under tools/node/<part>/go.mod, into a cache folder outside the repo. Prints that
# folder on the last line of stdout (tools/buildcache.sh). Warm cache: returns at once. Cold:
# see docs/development.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

. ../buildcache.sh
# The pins and this script's flags decide the binaries, so they alone make the cache key.
key=$(bc_key build.sh */go.mod */go.sum)
bc_begin node "$key"
bc_need go "install Go 1.26+ from your distribution or go.dev"
bc_need gcc "runc's nsenter and seccomp support are C (apt-get install gcc)"
if ! pkg-config --exists libseccomp 2>/dev/null; then
  echo "error: libseccomp headers are needed to build runc with seccomp (apt-get install libseccomp-dev)" >&2
  exit 2
fi
mkdir -p "$BC_TMP/cni"

version_of() { awk -v m="$2" '$1==m && $2 ~ /^v/ {print $2; exit}' "$1/go.mod"; }
build() { # <module dir> <output> <package> [go build args...]
  local dir=$1 dest=$2 pkg=$3
  shift 3
  bc_log "go build $(basename "$dest")"
  local start
  start=$(date +%s)
  (cd "$dir" && go build -trimpath "$@" -o "$BC_TMP/$dest" "$pkg") >&2
  bc_log "built $(basename "$dest") in $(($(date +%s) - start))s"
}

for d in containerd runc cni kubelet; do
  (cd "$d" && bc_go_download)
done

ctrd_ver=$(version_of containerd github.com/containerd/containerd/v2)
ctrd_ld="-s -w -X github.com/containerd/containerd/v2/version.Version=$ctrd_ver"
ctrd_ld+=" -X github.com/containerd/containerd/v2/version.Revision=flexgpu-$key"
for b in containerd containerd-shim-runc-v2 ctr; do
  CGO_ENABLED=0 build containerd "$b" "github.com/containerd/containerd/v2/cmd/$b" \
    -tags "no_btrfs no_devmapper no_zfs urfave_cli_no_docs" -ldflags "$ctrd_ld"
done

# runc needs cgo: its nsenter is C, and seccomp filters come from libseccomp.
runc_ver=$(version_of runc github.com/opencontainers/runc)
CGO_ENABLED=1 build runc runc github.com/opencontainers/runc \
  -tags "seccomp urfave_cli_no_docs" -ldflags "-s -w -X main.version=${runc_ver#v}"

for p in main/bridge ipam/host-local main/loopback; do
  CGO_ENABLED=0 build cni "cni/$(basename "$p")" \
    "github.com/containernetworking/plugins/plugins/$p" -ldflags "-s -w"
done

# Same version stamping as the control plane, so the node reports v1.37.x like the server.
k8s_ver=$(version_of kubelet k8s.io/kubernetes)
minor=$(echo "$k8s_ver" | cut -d. -f2)
kube_ld="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ld+=" -X $p.gitVersion=$k8s_ver -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  kube_ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
CGO_ENABLED=0 build kubelet kubelet k8s.io/kubernetes/cmd/kubelet -ldflags "$kube_ld"

bc_finish
