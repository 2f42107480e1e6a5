#!/usr/bin/env bash
# Builds the Go programs the flexgpu image ships (release/image.py copies them in): our
# flexgpu-cdi-common (the NVIDIA Container Toolkit's generator for the CDI edits every GPU
# container needs) and flexgpu-cdi-hooks (the toolkit's hooks, several in one process), and
# beside them nvidia-ctk and nvidia-cdi-hook from the toolkit this module pins. Into the tool
# cache (tools/buildcache.sh); prints the folder on the last line of stdout. Warm: at once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
. ../tools/buildcache.sh

# The key covers everything that changes the programs: module pins, this script and our own Go
# sources.
key=$(bc_key go.mod go.sum build.sh $(find . -name '*.go' | LC_ALL=C sort))
bc_begin hooks "$key"
bc_need go "install Go 1.26+ and a C compiler"
bc_need gcc "the toolkit's programs are cgo (apt-get install gcc)"

bc_log "building nvidia-ctk, nvidia-cdi-hook, flexgpu-cdi-common and flexgpu-cdi-hooks into $BC_OUT"
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
  CGO_ENABLED=1 go build -trimpath -ldflags "$ldflags" -o "$BC_TMP/$b" "${pkg[$b]}" 2>"$log_file" \
    || { cat "$log_file" >&2; rm -f "$log_file"; exit 2; }
  rm -f "$log_file"
  bc_log "built $b in $(( $(date +%s) - start ))s"
done
bc_finish
