#!/usr/bin/env bash
# Builds nvidia-ctk and nvidia-cdi-hook (NVIDIA Container Toolkit, pinned in go.mod) and our
# flexgpu-cdi-common (the toolkit's generator for the CDI edits every GPU container needs) and
# flexgpu-cdi-hooks (the toolkit's hooks, several in one process) into a cache folder outside
# the repo, and prints that folder on the last line of stdout.
# A warm cache returns at once. tools/images copies these programs into the image.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

cache_root=${FLEXGPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flexgpu}
# The key covers everything that changes the programs: module pins and our own Go sources.
key=$(cat go.mod go.sum build.sh $(find . -name '*.go' | LC_ALL=C sort) | sha256sum | cut -c1-12)
out="$cache_root/nvidia-ctk-$key"

if [ -f "$out/.complete" ]; then
  echo "$out"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "error: the Go toolchain (go 1.26+) and a C compiler are needed to build nvidia-ctk." >&2
  exit 2
fi

# Two builds of one key at once (several shells or worktrees) would share the .tmp folder and
# mark a half-built folder complete: the second waits for the first and then finds it done.
mkdir -p "$cache_root"
exec 9>"$out.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "$out"
  exit 0
fi
log() { printf '[nvidia-ctk %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
log "building nvidia-ctk, nvidia-cdi-hook and flexgpu-cdi-common into $out"
if ! go mod download >&2; then
  echo "error: downloading Go modules failed; check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY))." >&2
  exit 2
fi
rm -rf "$out.tmp"
mkdir -p "$out.tmp"
declare -A pkg=(
  [nvidia-ctk]=github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk
  [nvidia-cdi-hook]=github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook
  [flexgpu-cdi-common]=./cmd/flexgpu-cdi-common
  [flexgpu-cdi-hooks]=./cmd/flexgpu-cdi-hooks
)
for b in nvidia-ctk nvidia-cdi-hook flexgpu-cdi-common flexgpu-cdi-hooks; do
  start=$(date +%s)
  # cgo: go-nvml loads libnvidia-ml.so.1 with dlopen at run time (nothing links against it).
  ldflags="-s -w"
  if [ "$b" = nvidia-cdi-hook ] || [ "$b" = flexgpu-cdi-hooks ]; then
    # The hooks run on the host, whatever its glibc: linked statically (its subcommands that
    # CDI specs name load no NVML, so the dlopen warning of a static link does not apply).
    ldflags="$ldflags -linkmode external -extldflags -static"
  fi
  CGO_ENABLED=1 go build -trimpath -ldflags "$ldflags" -o "$out.tmp/$b" "${pkg[$b]}" 2> "$out.tmp/$b.log" \
    || { cat "$out.tmp/$b.log" >&2; exit 2; }
  log "built $b in $(( $(date +%s) - start ))s"
done
rm -f "$out.tmp"/*.log
touch "$out.tmp/.complete"
rm -rf "$out"
mv "$out.tmp" "$out"
# Keep this build and the one before it; drop older ones.
ls -dt "$cache_root"/nvidia-ctk-*/ 2>/dev/null | tail -n +3 | xargs -r rm -rf
echo "$out"
