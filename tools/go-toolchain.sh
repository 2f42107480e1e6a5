#!/usr/bin/env bash
# The Go toolchain the builds of `make demo` and `make test` need: when `go` is older than the
# newest `go`/`toolchain` line of the modules under tools/ (or older than 1.21, the first that
# switches toolchains by itself, which tools/karpenter's GOTOOLCHAIN relies on), it fetches that
# toolchain from the Go module proxy into a cache folder, never into the repo:
#
#   tools/go-toolchain.sh [--check]   install when needed (--check: only say what is missing)
#   tools/go-toolchain.sh need        print the version the builds need (e.g. 1.26.8)
#   tools/go-toolchain.sh bin-dir     print the folder to put first on PATH (the Makefile does)
#
# The toolchain comes as the module golang.org/toolchain@v0.0.1-go<version>.<os>-<arch>, the one
# GOTOOLCHAIN itself downloads, fetched with `go mod download` so that its checksum is checked
# against sum.golang.org. Any go can fetch it, even one that predates GOTOOLCHAIN (Debian 12's
# golang-go is 1.19, Ubuntu 22.04's 1.18), so a machine without Go needs only that package,
# which tools/system-deps.sh installs. The decision path is plain bash: it runs on a bare PATH.
set -euo pipefail

here=${BASH_SOURCE[0]%/*}
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
here=$(cd "$here" && pwd)
cache_root=${FLEXGPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flexgpu}
dir="$cache_root/go"
# GOTOOLCHAIN appeared in 1.21; below it a module that names its own toolchain cannot be built.
floor=1.21.0

# A Go version as five numbers (major minor patch stage n), stage 0 beta, 1 rc, 2 release, so
# that 1.26rc1 < 1.26.0 < 1.26.8 < 1.26.10 compare as Go orders them. Empty for anything else.
version_key() {
  local v=${1#go}
  if [[ "$v" =~ ^([0-9]+)\.([0-9]+)(\.([0-9]+))?((beta|rc)([0-9]+))?$ ]]; then
    local stage=2 n=0
    case "${BASH_REMATCH[6]}" in
      beta) stage=0 n=${BASH_REMATCH[7]} ;;
      rc) stage=1 n=${BASH_REMATCH[7]} ;;
    esac
    echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ${BASH_REMATCH[4]:-0} $stage $n"
  fi
}

# True when version $1 is at least $2 (both valid; callers check).
at_least() {
  local -a a b
  read -r -a a <<<"$(version_key "$1")"
  read -r -a b <<<"$(version_key "$2")"
  local i
  for i in 0 1 2 3 4; do
    ((10#${a[$i]} > 10#${b[$i]})) && return 0
    ((10#${a[$i]} < 10#${b[$i]})) && return 1
  done
  return 0
}

# The newest go or toolchain line among the modules the builds use. A module whose build.sh sets
# GOTOOLCHAIN picks its own toolchain (any go from 1.21 fetches it), so its lines are its own.
need_version() {
  local best=$floor mod word value
  for mod in "$here"/*/go.mod "$here"/*/*/go.mod; do
    [ -f "$mod" ] || continue
    case "$mod" in */releases/*) continue ;; esac # older Kubernetes releases: lower lines
    if [ -f "${mod%/go.mod}/build.sh" ] && [[ "$(<"${mod%/go.mod}/build.sh")" == *"GOTOOLCHAIN="* ]]; then
      continue
    fi
    while read -r word value _; do
      if [ "$word" = go ] || [ "$word" = toolchain ]; then
        if [ -z "$(version_key "$value")" ]; then
          echo "error: $mod: '$word $value' is not a Go version (allowed: 1.N, 1.N.P, 1.NrcK)" >&2
          exit 2
        fi
        at_least "$value" "$best" || continue
        best=${value#go}
      fi
    done <"$mod"
  done
  # A language version (1.26) is met by its first release, which the proxy names go1.26.0.
  [[ "$best" =~ ^[0-9]+\.[0-9]+$ ]] && best=$best.0
  echo "$best"
}

# The version of the go on PATH ("" when there is none; "devel" for a source build).
current_version() {
  command -v go >/dev/null 2>&1 || return 0
  local out
  # From /, so that no go.mod around makes a newer go switch toolchains while answering.
  out=$(cd / && go version 2>/dev/null) || return 0
  local -a words
  read -r -a words <<<"$out"
  echo "${words[2]:-}"
}

install_toolchain() { # <version>
  local version=$1 goos goarch mod src
  goos=$(cd / && GOFLAGS= go env GOHOSTOS)
  goarch=$(cd / && GOFLAGS= go env GOHOSTARCH)
  mod="golang.org/toolchain@v0.0.1-go$version.$goos-$goarch"
  mkdir -p "$dir"
  # Several worktrees may run make at once: one fetches, the others find it done.
  exec 8>"$dir/.lock"
  flock 8
  if [ -x "$dir/go$version/bin/go" ]; then
    ln -sfn "go$version/bin" "$dir/bin.new" && mv -T "$dir/bin.new" "$dir/bin"
    return 0
  fi
  # What a run killed half-way left (the lock says no other run is at work).
  chmod -R u+w "$dir"/.download.* 2>/dev/null || true
  rm -rf "$dir"/.download.* "$dir/go$version.tmp"
  echo "==> Go $version from the Go module proxy into $dir (a download of about 70 MB)" >&2
  # The module cache is read-only by design; a private one is removed whole afterwards.
  tmp=$(mktemp -d "$dir/.download.XXXXXX")
  trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
  if ! (cd "$tmp" && GOMODCACHE="$tmp/mod" GOFLAGS= GO111MODULE=on GOTOOLCHAIN=local \
    go mod download "$mod" >&2); then
    echo "error: fetching $mod failed; check that the Go module proxy is reachable" \
      "(GOPROXY=$(cd / && go env GOPROXY))" >&2
    exit 2
  fi
  src="$tmp/mod/$mod"
  chmod -R u+w "$src"
  mv "$src" "$dir/go$version.tmp"
  # Module zips carry no file modes; the go command sets these same bits after its own fetch.
  chmod 0755 "$dir/go$version.tmp"/bin/* "$dir/go$version.tmp"/pkg/tool/*/*
  local got
  got=$("$dir/go$version.tmp/bin/go" version)
  if [[ "$got" != "go version go$version "* ]]; then
    echo "error: $mod holds '$got', not go$version" >&2
    rm -rf "$dir/go$version.tmp"
    exit 2
  fi
  mv -T "$dir/go$version.tmp" "$dir/go$version"
  ln -sfn "go$version/bin" "$dir/bin.new" && mv -T "$dir/bin.new" "$dir/bin"
  echo "==> $got in $dir/bin" >&2
}

case "${1:-}" in
  need)
    need_version
    exit 0
    ;;
  bin-dir)
    echo "$dir/bin"
    exit 0
    ;;
  "" | --check) ;;
  *)
    echo "usage: $0 [--check|need|bin-dir] (got '$1')" >&2
    exit 2
    ;;
esac

need=$(need_version)
current=$(current_version)
if [ "$current" = devel ]; then
  echo "note: go on PATH is a development build; taking it as at least $need" >&2
  exit 0
fi
if [ -n "$current" ] && [ -n "$(version_key "$current")" ] && at_least "$current" "$need"; then
  exit 0
fi
if [ -z "$current" ]; then
  echo "missing: go (the builds need $need; Debian's golang-go fetches it)" >&2
else
  echo "missing: go $need (go on PATH is ${current#go}, from $(command -v go))" >&2
fi
[ "${1:-}" = --check ] && exit 1
if [ -z "$current" ]; then
  echo "error: no go on PATH to fetch Go $need with: install your distribution's Go (Debian," \
    "Ubuntu: apt-get install golang-go; any version) or Go $need from go.dev" >&2
  exit 2
fi
install_toolchain "$need"
