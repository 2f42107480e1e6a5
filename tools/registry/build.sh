#!/usr/bin/env bash
# Builds the OCI image registry the real-node tests pull the flexgpu image from: CNCF
# distribution's registry (github.com/distribution/distribution/v3, pinned in go.mod) with its
# filesystem storage driver only (cmd/flexgpu-registry), into a cache folder outside the repo.
# Prints that folder on the last line of stdout (tools/buildcache.sh); a warm cache returns at
# once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
. ../buildcache.sh

# The key covers everything that changes the program: module pins, this script and our own Go
# sources.
key=$(bc_key go.mod go.sum build.sh $(find . -name '*.go' | LC_ALL=C sort))
bc_begin registry "$key"
bc_need go "install Go 1.26+ from your distribution or go.dev"

bc_log "building the image registry (distribution) into $BC_OUT"
bc_go_download
start=$(date +%s)
# Pure Go: no C compiler, the same program on every Linux.
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$BC_TMP/flexgpu-registry" ./cmd/flexgpu-registry >&2
bc_log "built flexgpu-registry in $(( $(date +%s) - start ))s"
bc_finish
