#!/usr/bin/env bash
# Runs the README's commands on a machine that has nothing: a minimal Debian root filesystem
# (mmdebstrap's minbase variant: the essential packages and apt, so no Go, no gcc, no Python),
# a clean copy of this checkout's HEAD (git archive) in /root/flexgpu, and then, as root inside
# it, one of:
#
#   tools/fresh-machine/run.sh go     make system-deps, then `go version` as make's builds see
#                                     it (Debian's golang-go fetching the toolchain: minutes)
#   tools/fresh-machine/run.sh demo   make demo, then make demo-down (cold: every build)
#
# and prints how long the command took. The root filesystem is made anew each run under
# FLEXGPU_FRESH_DIR (default /var/tmp/flexgpu-fresh-machine; FLEXGPU_FRESH_SUITE picks the
# Debian release, default bookworm), so its caches (Go modules, builds, the venv's wheels) start
# empty and stay there: nothing of this machine's ~/.cache/flexgpu is used. It runs in mount and
# PID namespaces of its own, with /proc, /sys (cgroups included), /dev and a /run of its own
# mounted as the demo's real node needs; every process it started ends with it, and the
# network is this machine's (the Debian mirror, PyPI and the Go module proxy must be reachable).
# The demo's real node takes this machine's /tmp/flexgpu-realnode.lock (FLEXGPU_REALNODE_LOCK)
# like the real-node tests; the time printed leaves out the wait for it.
# Needs root (chroot, mounts); installs mmdebstrap with apt-get when it is missing.
set -euo pipefail

what=${1:-}
case "$what" in
  go | demo) ;;
  *)
    echo "usage: $0 go|demo (got '$what')" >&2
    exit 2
    ;;
esac
if [ "$(id -u)" -ne 0 ]; then
  echo "error: run as root: a root filesystem is made with mmdebstrap and entered with chroot" >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/../.." && pwd)
base=${FLEXGPU_FRESH_DIR:-/var/tmp/flexgpu-fresh-machine}
suite=${FLEXGPU_FRESH_SUITE:-bookworm}
rootfs="$base/rootfs-$what"

mkdir -p "$base"
# One run per root filesystem: its mounts live in its own namespace, invisible from here.
exec 7>"$rootfs.lock"
if ! flock -n 7; then
  echo "error: a '$what' run is still using $rootfs (it holds $rootfs.lock)" >&2
  exit 2
fi
if ! command -v mmdebstrap >/dev/null 2>&1; then
  echo "==> apt-get install mmdebstrap" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
fi

# A previous run's root filesystem goes first: a cold run means empty caches.
rm -rf "$rootfs"
start=$SECONDS
echo "==> Debian $suite (minbase) into $rootfs" >&2
mmdebstrap --quiet --mode=root --variant=minbase "$suite" "$rootfs" http://deb.debian.org/debian
echo "==> root filesystem made in $((SECONDS - start)) s: $(du -sh "$rootfs" | cut -f1)" >&2
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
# The network is this machine's: a CA it added for a proxy that intercepts HTTPS is added to
# the fresh machine too (ca-certificates takes it in when system-deps installs that package).
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  mkdir -p "$rootfs/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
fi
mkdir -p "$rootfs/root/flexgpu"
git -C "$repo" archive HEAD | tar -x -C "$rootfs/root/flexgpu"
echo "==> $(git -C "$repo" rev-parse --short HEAD) of $repo copied to /root/flexgpu" >&2

# What runs inside: a newcomer's shell as root. make itself is the one thing a bare Debian
# lacks before the README's first command can run, so it is installed the way they would.
case "$what" in
  go)
    inner='make system-deps
echo "go on make'"'"'s PATH: $(make -s --eval "go-path: ; @command -v go; go version" go-path)"'
    ;;
  demo)
    # `make demo` in two steps, the same work: its setup (every build, the longest part), then
    # the demo itself, whose real node waits its turn with the machine's real-node tests.
    inner='make setup
built=$(date +%s)
exec 9>/tmp/flexgpu-realnode.lock
flock 9
waited=$(( $(date +%s) - built ))
echo "==> setup took $(( built - start )) s; waited $waited s for the real-node lock"
make demo
make demo-down
start=$(( start + waited ))'
    ;;
esac
script="set -euo pipefail
cd /root/flexgpu
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends make >/dev/null
start=\$(date +%s)
$inner
end=\$(date +%s)
echo \"==> cold $what inside the fresh machine: \$(( (end - start) / 60 )) min \$(( (end - start) % 60 )) s\""

# PID 1 of the new PID namespace mounts the machine's file systems into the root filesystem
# (private to its mount namespace: they vanish with it) and enters it with a clean environment.
unshare --mount --pid --fork --propagation private -- bash -euo pipefail -c '
  rootfs=$1 script=$2 lock=$3
  mount -t proc proc "$rootfs/proc"
  mount --rbind /sys "$rootfs/sys"
  mount --rbind /dev "$rootfs/dev"
  mount -t tmpfs tmpfs "$rootfs/run"
  # Real nodes run one at a time machine-wide: the fresh machine shares the lock file.
  touch "$lock" "$rootfs/tmp/flexgpu-realnode.lock"
  mount --bind "$lock" "$rootfs/tmp/flexgpu-realnode.lock"
  exec chroot "$rootfs" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash -c "$script"
' fresh-machine "$rootfs" "$script" "${FLEXGPU_REALNODE_LOCK:-/tmp/flexgpu-realnode.lock}"
