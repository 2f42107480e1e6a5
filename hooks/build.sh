#!/usr/bin/env bash
# Builds the Go programs the flexgpu image ships (release/image.py copies them in): our
# flexgpu-cdi-common (the NVIDIA Container Toolkit's generator for the CDI edits every GPU
# container needs) and flexgpu-cdi-hooks (the toolkit's hooks, several in one process), and
# beside them nvidia-ctk and nvidia-cdi-hook from the toolkit this module pins. Into the tool
# cache (tools/buildcache.sh); prints the folder on the last line of stdout. Warm: at once.
#
#   hooks/build.sh [amd64|arm64]    (default amd64)
#
# arm64 is cross-compiled the same way (cgo, the same static hooks) with Debian's aarch64 cross
# compiler: go-nvml and the toolkit's dxcore are cgo only, so CGO off builds none of them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
. ../tools/buildcache.sh

arch=${1:-amd64}
case "$arch" in
  amd64) cc=x86_64-linux-gnu-gcc cross="gcc (apt-get install gcc libc6-dev)" ;;
  arm64) cc=aarch64-linux-gnu-gcc cross="apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross" ;;
  *)
    echo "error: hooks/build.sh: architecture '$arch' is not built; allowed: amd64, arm64" >&2
    exit 2
    ;;
esac
# On an amd64 machine x86_64-linux-gnu-gcc is gcc itself; elsewhere it is Debian's cross gcc.
if [ "$(go env GOHOSTARCH 2>/dev/null || true)" = "$arch" ] && command -v gcc >/dev/null 2>&1; then
  cc=gcc
fi

# The key covers everything that changes the programs: module pins, this script, our own Go
# sources and the architecture.
key=$( (bc_key go.mod go.sum build.sh $(find . -name '*.go' | LC_ALL=C sort); echo "$arch") \
  | sha256sum | cut -c1-12)
bc_begin hooks "$key"
bc_need go "install Go 1.26+ and a C compiler"
bc_need "$cc" "the toolkit's programs are cgo ($cross)"

bc_log "building nvidia-ctk, nvidia-cdi-hook, flexgpu-cdi-common and flexgpu-cdi-hooks for linux/$arch into $BC_OUT"
bc_go_download
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
  log_file=$(mktemp)
  CGO_ENABLED=1 GOOS=linux GOARCH="$arch" CC="$cc" go build -trimpath -ldflags "$ldflags" -o "$BC_TMP/$b" "${pkg[$b]}" 2>"$log_file" \
    || { cat "$log_file" >&2; rm -f "$log_file"; exit 2; }
  rm -f "$log_file"
  bc_log "built $b in $(( $(date +%s) - start ))s"
done
bc_finish
