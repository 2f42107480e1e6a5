#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-scheduler, kube-controller-manager (and the kubelet
# harness) from the pinned upstream modules into a cache folder outside the repo, and
# prints that folder on the last line of stdout. A warm cache returns in well under a second.
#
# Release: `build.sh 1.34` or K8S=1.34 picks the module under releases/1.34 (go.mod, go.sum,
# and *.patch applied to our Go sources where that release's kubelet API differs); empty or
# the default module's own minor builds from tools/k8s/go.mod exactly as before, same key.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
. ../buildcache.sh

release=${1:-${K8S:-}}
release=${release#v}
default_version=$(awk '$1=="k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' go.mod)
default_minor=$(echo "$default_version" | cut -d. -f1,2 | tr -d v)
release_dir=""
src=""
if [ -z "$release" ] || [ "$release" = "$default_minor" ]; then
  K8S_VERSION=$default_version
  # The key covers everything that changes the binaries: module pins and our own Go sources.
  key=$(bc_key go.mod go.sum $(find . -path ./releases -prune -o -name '*.go' -print | LC_ALL=C sort))
else
  if [[ ! "$release" =~ ^1\.[0-9]+$ ]] || [ ! -f "releases/$release/go.mod" ]; then
    echo "error: K8S=$release is not a release tools/k8s builds; allowed: $default_minor" \
      "$(ls releases 2>/dev/null | grep -E '^1\.[0-9]+$' | tr '\n' ' ')(pin one with releases/pin.sh)" >&2
    exit 2
  fi
  release_dir="releases/$release"
  K8S_VERSION=$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3; exit}' "$release_dir/go.mod")
  # Same key rule, over what this release builds: its pins, our sources and its patches.
  key=$(bc_key "$release_dir/go.mod" "$release_dir/go.sum" \
    $(find . -path ./releases -prune -o -name '*.go' -print | LC_ALL=C sort) \
    $(find "$release_dir" -maxdepth 1 -name '*.patch' | LC_ALL=C sort))
fi
# The harness first: it uses kubelet internals, the part most likely not to compile against
# a release, so such a failure shows in minutes rather than after the control plane.
bins=(kubelet-harness etcd kube-apiserver kube-scheduler kube-controller-manager)
# Eviction weighs this build against the others of its minor release only: other releases'
# builds are other artefacts.
bc_begin "k8s-$K8S_VERSION" "$key" "" "k8s-$(echo "$K8S_VERSION" | cut -d. -f1,2).*"
out=$BC_OUT

if ! command -v go >/dev/null 2>&1; then
  echo "error: the Go toolchain (go 1.26+) is needed to build the local control plane." >&2
  echo "  Install it from your distribution or go.dev, or point KUBEBUILDER_ASSETS at a folder" >&2
  echo "  that holds etcd, kube-apiserver, kube-scheduler and kube-controller-manager v1.37." >&2
  exit 2
fi
log() { bc_log "$@"; }
log "building Kubernetes $K8S_VERSION control plane into $out (a cold build takes 15-30 min on 2 cores)"
if [ -n "$release_dir" ]; then
  # Go builds only inside a module's folder: assemble the release's module from its pins,
  # our sources and its patches in the build folder, removed when done.
  src="$BC_TMP/src"
  mkdir -p "$src"
  cp -r cmd tools.go "$src/"
  cp "$release_dir/go.mod" "$release_dir/go.sum" "$src/"
  for p in $(find "$release_dir" -maxdepth 1 -name '*.patch' | LC_ALL=C sort); do
    if ! patch -d "$src" -p1 --quiet --no-backup-if-mismatch <"$p" >&2; then
      echo "error: $p no longer applies to tools/k8s/cmd; refresh it against the current sources." >&2
      exit 2
    fi
  done
  cd "$src"
fi
bc_go_download

minor=$(echo "$K8S_VERSION" | cut -d. -f2)
pkgver=k8s.io/component-base/version
cliver=k8s.io/client-go/pkg/version
ldflags="-s -w"
for p in $pkgver $cliver; do
  ldflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

declare -A pkg=(
  [etcd]=./cmd/etcd
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
  [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
  [kubelet-harness]=./cmd/kubelet-harness
)
for b in "${bins[@]}"; do
  [ -d "${pkg[$b]}" ] || [[ "${pkg[$b]}" != ./* ]] || { log "skipping $b (no sources)"; continue; }
  log "go build $b"
  start=$(date +%s)
  CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$BC_TMP/$b" "${pkg[$b]}" >&2
  log "built $b in $(( $(date +%s) - start ))s"
done
cd "$here"
[ -z "$src" ] || rm -rf "$src"
bc_finish
