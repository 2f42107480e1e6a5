#!/usr/bin/env bash
# The Debian packages that `make demo` (set "node") and `make test` (set "test") need on the
# machine itself, installed with apt-get when any is missing, then the Go toolchain the go.mod
# files need (tools/go-toolchain.sh: from Debian's golang-go when there is no go at all).
# Everything else (Go modules, PyPI wheels, helm and kubectl) the other set-up steps fetch into
# caches of their own.
#
#   tools/system-deps.sh node|test [--check]
#
# As root it installs what is missing; not as root it prints one line naming the command to run
# and exits 2 (the Go toolchain needs no root: it goes into the user's cache); with --check it
# only lists what is missing (exit 1 if anything is).
# FLEXGPU_APT_GET overrides the apt-get command (the tests point it at a recorder).
set -euo pipefail

# The script's folder, without dirname: the tests run it on a PATH of bash and id only.
here=${BASH_SOURCE[0]%/*}
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
set_name=${1:-}
mode=${2:-install}
case "$set_name" in
  node | test) ;;
  *)
    echo "usage: $0 node|test [--check] (got '${set_name}')" >&2
    exit 2
    ;;
esac

apt_get=${FLEXGPU_APT_GET:-apt-get}
missing=()
need_lists=0

have() { command -v "$1" >/dev/null 2>&1; }
want() { # <package> <why>
  local pkg=$1
  for m in "${missing[@]+"${missing[@]}"}"; do [ "$m" = "$pkg" ] && return 0; done
  missing+=("$pkg")
  echo "missing: $pkg ($2)" >&2
}

# The virtualenv (make venv) and every HTTPS download (PyPI, the Go module proxy): a fresh
# Debian has neither Python nor CA certificates.
if ! have python3 || ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  want python3-venv "make venv creates .venv with pip"
fi
[ -s /etc/ssl/certs/ca-certificates.crt ] || want ca-certificates "HTTPS downloads from PyPI and the Go module proxy"
# The real node: runc is built with cgo and seccomp; the node runs in namespaces of its own.
have gcc || want gcc "runc's nsenter and seccomp parts are C"
# gcc only recommends the C library's headers, and recommends are not installed here.
[ -f /usr/include/stdio.h ] && [ -f /usr/include/elf.h ] || want libc6-dev "C headers for runc's cgo build"
have pkg-config || want pkg-config "finds libseccomp for runc's build"
if ! have pkg-config || ! pkg-config --exists libseccomp 2>/dev/null; then
  want libseccomp-dev "runc is built with seccomp"
fi
have ip || want iproute2 "the node's network namespace"
{ have unshare && have nsenter; } || want util-linux "the node's mount and PID namespaces"
have mount || want mount "the node's mounts"
# Any go can fetch the toolchain the builds need; with none, Debian's (1.19 on Debian 12) does.
have go || want golang-go "fetches the Go toolchain the go.mod files need (tools/go-toolchain.sh)"
# The node's images are assembled from Debian packages fetched with `apt-get download`,
# which needs the package lists (a fresh machine or container often has none).
if ! apt-cache show busybox-static >/dev/null 2>&1; then
  need_lists=1
  echo "missing: the apt package lists (the node's images are made from Debian packages)" >&2
fi

if [ "$set_name" = test ]; then
  # promtool checks the chart's alert rules; the Prometheus integration test runs a server.
  { have promtool && have prometheus; } || want prometheus "promtool and prometheus for the metrics tests"
  # The release image's arm64 half (tests/integration/test_release_image_arm64.py): its Go
  # programs are cgo, cross-compiled; it is started under qemu.
  if [ "$HOSTTYPE" != aarch64 ]; then
    have aarch64-linux-gnu-gcc || want gcc-aarch64-linux-gnu "cross-compiles the arm64 image's Go programs"
    [ -f /usr/aarch64-linux-gnu/include/stdio.h ] || want libc6-dev-arm64-cross "C headers and static libc for the arm64 Go programs"
    have qemu-aarch64-static || want qemu-user-static "starts the arm64 image's programs"
  fi
fi

# qemu-user-static's handler for arm64 programs, registered with binfmt_misc where the kernel
# lets this machine (a container may not mount it): the arm64 image test skips, saying why,
# where it is absent. Only as root and only for the test set.
register_arm64() {
  local conf=/usr/lib/binfmt.d/qemu-aarch64.conf dir=/proc/sys/fs/binfmt_misc
  [ "$set_name" = test ] && [ "$mode" != --check ] && [ "$(id -u)" -eq 0 ] || return 0
  [ -f "$conf" ] && [ ! -e "$dir/qemu-aarch64" ] || return 0
  if { [ -e "$dir/register" ] || mount -t binfmt_misc binfmt_misc "$dir" 2>/dev/null; } &&
    cat "$conf" >"$dir/register" 2>/dev/null; then
    echo "==> registered qemu-aarch64 with binfmt_misc" >&2
  else
    echo "note: binfmt_misc cannot be registered here: the arm64 image test will skip" >&2
  fi
}

if [ ${#missing[@]} -eq 0 ] && [ $need_lists -eq 0 ]; then
  [ "$mode" = --check ] && exec bash "$here/go-toolchain.sh" --check
  register_arm64
  exec bash "$here/go-toolchain.sh"
fi
if [ "$mode" = --check ]; then
  have go && { bash "$here/go-toolchain.sh" --check || true; }
  exit 1
fi
if ! have "$apt_get"; then
  echo "error: missing ${missing[*]:-package lists} and no apt-get here: install the equivalents with your distribution's package manager" >&2
  exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "error: run as root first: apt-get update && apt-get install -y --no-install-recommends ${missing[*]:-}" >&2
  exit 2
fi

echo "==> apt-get install ${missing[*]:-(package lists only)}" >&2
"$apt_get" update -qq >/dev/null
if [ ${#missing[@]} -gt 0 ]; then
  # No service is wanted from these packages (the tests start their own Prometheus on a free
  # port), and a container without an init system cannot start one anyway.
  DEBIAN_FRONTEND=noninteractive "$apt_get" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
register_arm64
# golang-go is any version; the one the go.mod files need comes from the Go module proxy.
exec bash "$here/go-toolchain.sh"
