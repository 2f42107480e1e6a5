#!/usr/bin/env bash
# Writes tools/k8s/releases/<minor>/go.mod and go.sum for one Kubernetes release, e.g.
#   bash tools/k8s/releases/pin.sh 1.34.12
# k8s.io/kubernetes requires its staging modules as v0.0.0 through ./staging replaces, so every
# staging module is pinned to the matching v0.<minor>.<patch> tag; etcd and the rest come from
# the release's own go.mod through `go mod tidy`. The Go sources built are tools/k8s's own,
# with releases/<minor>/*.patch applied where that release's kubelet API differs.
set -euo pipefail
version=${1:?usage: pin.sh 1.MINOR.PATCH}
[[ "$version" =~ ^1\.([0-9]+)\.([0-9]+)$ ]] || { echo "error: version $version is not 1.MINOR.PATCH" >&2; exit 2; }
minor=${BASH_REMATCH[1]}
staging="v0.$minor.${BASH_REMATCH[2]}"
here=$(cd "$(dirname "$0")" && pwd)
k8s=$(dirname "$here")
dest="$here/1.$minor"

upstream_mod=$(go mod download -json "k8s.io/kubernetes@v$version" |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$k8s/cmd" "$k8s/tools.go" "$work/"
{
  echo "// Kubernetes v$version for flexgpu's tests; written by tools/k8s/releases/pin.sh."
  echo "module flexgpu.dev/tools/k8s"
  echo
  echo "go $(awk '$1=="go" {print $2; exit}' "$upstream_mod")"
  echo
  echo "require k8s.io/kubernetes v$version"
  # The harness's own non-Kubernetes dependencies stay at the default module's versions.
  awk '$1=="require" && $2=="(" {r=1; next} r && $1==")" {exit} r && $1 !~ /^(k8s\.io|go\.etcd\.io)\// {print "require " $1 " " $2}' "$k8s/go.mod"
  echo
  echo "replace ("
  awk -v v="$staging" '$1 ~ /^k8s\.io\// && $2=="=>" && $3 ~ /^\.\/staging\// {printf "\t%s => %s %s\n", $1, $1, v}' "$upstream_mod"
  echo ")"
} >"$work/go.mod"
(cd "$work" && go mod tidy >&2)
mkdir -p "$dest"
cp "$work/go.mod" "$work/go.sum" "$dest/"
echo "$dest"
