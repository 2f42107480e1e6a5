# The build cache every build script sources (tools/buildcache.py holds the same rules for the
# builds written in Python, and the way Python asks for an artefact). docs/development.md,
# "The build cache", states the rules:
#   key         the first 12 hex digits of SHA-256 over the inputs a build declares, in order;
#   entry       $FLEXGPU_CACHE/<name>-<key>/ (default ~/.cache/flexgpu), an artefact's folder;
#   lock        <entry>.lock, taken with flock around the build, so one build per entry runs;
#   mark        <entry>/.complete, written last: an entry without it does not exist;
#   temp        a build fills <entry>.tmp/ and renames it into place, so a crash leaves no half
#               entry, and the next build clears what it left;
#   eviction    after a build, entries of the same artefact go when not used for
#               $FLEXGPU_CACHE_KEEP_DAYS days (default 14), unless they are the current key
#               or another process holds their lock. A hit touches the mark: a use.
# A script sources this file, computes its key with bc_key, calls bc_begin (which returns at
# once on a hit), builds into $BC_TMP and calls bc_finish.
#
# Callers learn the entry without parsing output: with FLEXGPU_BUILDCACHE_REPORT naming a
# file, the entry's path is written there; with FLEXGPU_BUILDCACHE_QUERY=1 nothing is built,
# the path is reported and the exit status says whether it is complete (0) or not (3).
# The path of the artefact (the entry, or the file in it a script names) is also printed on
# the last line of stdout, for people and shell callers.

bc_cache_root() {
  echo "${FLEXGPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flexgpu}"
}

# bc_key FILE...: the key of a build whose inputs are these files, in this order.
# Assign its output (key=$(bc_key ...)), so that a missing input stops the script.
bc_key() {
  local f
  for f in "$@"; do
    if [ ! -f "$f" ]; then
      echo "error: the build input $PWD/$f is missing" >&2
      return 2
    fi
  done
  cat "$@" | sha256sum | cut -c1-12
}

bc_log() {
  printf '[%s %s] %s\n' "${BC_NAME:-build}" "$(date +%H:%M:%S)" "$*" >&2
}

_bc_report() {
  if [ -n "${FLEXGPU_BUILDCACHE_REPORT:-}" ]; then
    printf '%s\n' "$BC_OUT" >"$FLEXGPU_BUILDCACHE_REPORT"
  fi
  echo "$BC_OUT${BC_RESULT:+/$BC_RESULT}"
}

# Opens <lock> on fd 9 and takes it. Eviction deletes a lock file it holds, so a lock taken on
# a file that is no longer at its path guards nothing: take the one that is.
_bc_lock() {
  local lock=$1
  while :; do
    exec 9>"$lock"
    flock 9
    if [ "$(stat -L -c %i /dev/fd/9)" = "$(stat -c %i "$lock" 2>/dev/null)" ]; then
      return 0
    fi
    exec 9>&-
  done
}

# bc_begin NAME KEY [RESULT] [FAMILY]: the entry NAME-KEY. RESULT names the file in it that
# the script prints (default: the folder); FAMILY is the glob of the entries eviction weighs
# against this one (default NAME-*). On a hit it reports and exits; on a miss it returns with
# the lock held and $BC_TMP an empty folder to build into.
bc_begin() {
  BC_NAME=$1
  BC_KEY=$2
  BC_RESULT=${3:-}
  BC_FAMILY=${4:-$1-*}
  BC_ROOT=$(bc_cache_root)
  BC_OUT="$BC_ROOT/$BC_NAME-$BC_KEY"
  BC_TMP="$BC_OUT.tmp"
  if [ "${FLEXGPU_BUILDCACHE_QUERY:-}" = 1 ]; then
    _bc_report
    [ -f "$BC_OUT/.complete" ] && exit 0
    exit 3
  fi
  if [ -f "$BC_OUT/.complete" ]; then
    touch "$BC_OUT/.complete" 2>/dev/null || true
    _bc_report
    exit 0
  fi
  mkdir -p "$BC_ROOT"
  # Two builds of one key (several shells or worktrees) would share the temp folder: the
  # second waits for the first and then finds the entry complete.
  _bc_lock "$BC_OUT.lock"
  if [ -f "$BC_OUT/.complete" ]; then
    _bc_report
    exit 0
  fi
  # What a build killed before its mark left behind.
  rm -rf "$BC_TMP" "$BC_OUT"
  mkdir -p "$BC_TMP"
}

# bc_go_download: the module's dependencies, with an error that says what to check.
bc_go_download() {
  if ! go mod download >&2; then
    echo "error: downloading the Go modules of $PWD failed; check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY))." >&2
    exit 2
  fi
}

# bc_need COMMAND WHY: stops with a clear error when a build tool is missing.
bc_need() {
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "error: $1 is needed to build $BC_NAME: $2" >&2
    exit 2
  fi
}

# bc_finish: marks $BC_TMP complete, renames it into place, evicts, reports.
bc_finish() {
  touch "$BC_TMP/.complete"
  mv "$BC_TMP" "$BC_OUT"
  bc_evict
  _bc_report
}

# Entries of this artefact not used for the keep period, except the current one and those
# whose lock another process holds (a build in progress); temp folders of builds that died.
bc_evict() {
  local minutes=$(( ${FLEXGPU_CACHE_KEEP_DAYS:-14} * 1440 )) entry base
  for entry in "$BC_ROOT"/$BC_FAMILY; do
    [ -d "$entry" ] || continue
    base=${entry%.tmp}
    [ "$base" != "$BC_OUT" ] || continue
    if [ "$base" = "$entry" ] && [ -f "$entry/.complete" ] &&
      [ -z "$(find "$entry/.complete" -mmin +"$minutes")" ]; then
      continue
    fi
    (
      exec 8>"$base.lock"
      flock -n 8 || exit 0
      rm -rf "$entry"
      [ -e "$base" ] || [ -e "$base.tmp" ] || rm -f "$base.lock"
      echo "[buildcache] evicted $entry" >&2
    )
  done
}
