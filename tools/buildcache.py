"""The build cache from Python: the rules of tools/buildcache.sh (key, entry, lock, completion
mark, eviction; docs/development.md, "The build cache"), and the one way Python code asks for
a built artefact.

``path("k8s", "1.34")`` runs the artefact's build script, which returns at once when the
entry is complete, and hands back the entry's folder. The script reports the folder through
a file (``FLEXGPU_BUILDCACHE_REPORT``), so its output stays free for people; ``lookup`` asks
where the entry is without building (``FLEXGPU_BUILDCACHE_QUERY``)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Every artefact built through the cache, by the name callers ask for, and its build script.
SCRIPTS: dict[str, Path] = {
    "k8s": REPO / "tools" / "k8s" / "build.sh",
    "node": REPO / "tools" / "node" / "build.sh",
    "registry": REPO / "tools" / "registry" / "build.sh",
    "nvml-mock": REPO / "tools" / "nvml-mock" / "build.sh",
    "nvidia-driver": REPO / "tools" / "nvidia-driver" / "build.sh",
    "example-driver": REPO / "tools" / "example-driver" / "build.sh",
    "karpenter": REPO / "tools" / "karpenter" / "build.sh",
    "helm": REPO / "tools" / "helm" / "fetch.sh",
    "hooks": REPO / "hooks" / "build.sh",
}
MARK = ".complete"
KEEP_DAYS_ENV = "FLEXGPU_CACHE_KEEP_DAYS"
DEFAULT_KEEP_DAYS = 14
# The exit status of a query whose entry is not complete (tools/buildcache.sh).
NOT_BUILT = 3


class BuildError(RuntimeError):
    pass


def cache_root() -> Path:
    """$FLEXGPU_CACHE, else $XDG_CACHE_HOME/flexgpu, else ~/.cache/flexgpu."""
    base = os.environ.get("FLEXGPU_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flexgpu"
    )
    return Path(base)


def key(inputs: Iterable[Path]) -> str:
    """The key of a build whose inputs are these files, in this order: what bc_key prints."""
    digest = hashlib.sha256()
    for item in inputs:
        if not item.is_file():
            raise BuildError(f"the build input {item} is missing")
        digest.update(item.read_bytes())
    return digest.hexdigest()[:12]


def _script(artefact: str) -> Path:
    script = SCRIPTS.get(artefact)
    if script is None:
        raise BuildError(f"unknown artefact {artefact!r}; allowed: {', '.join(sorted(SCRIPTS))}")
    return script


def _run(
    artefact: str, args: tuple[str, ...], query: bool, stream: bool, timeout: float | None
) -> tuple[int, str, Path | None]:
    script = _script(artefact)
    with tempfile.TemporaryDirectory(prefix="flexgpu-buildcache-") as tmp:
        report = Path(tmp) / "entry"
        env = {**os.environ, "FLEXGPU_BUILDCACHE_REPORT": str(report), "PYTHON": sys.executable}
        if query:
            env["FLEXGPU_BUILDCACHE_QUERY"] = "1"
        proc = subprocess.run(
            ["bash", str(script), *args],
            stdout=subprocess.DEVNULL,
            stderr=None if stream else subprocess.PIPE,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        entry = Path(report.read_text().strip()) if report.is_file() else None
    return proc.returncode, proc.stderr or "", entry


def path(artefact: str, *args: str, stream: bool = False, timeout: float | None = None) -> Path:
    """The complete entry of ``artefact`` built with ``args``, built first when missing.
    ``stream`` shows the build's progress on stderr; else its tail is in the error."""
    rc, err, entry = _run(artefact, args, query=False, stream=stream, timeout=timeout)
    script = _script(artefact)
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    command = " ".join(["bash", str(shown), *args])
    if rc != 0:
        detail = f":\n{err.strip()[-4000:]}" if err.strip() else f"; run `{command}` to see why"
        raise BuildError(f"building {artefact} failed (exit {rc}){detail}")
    if entry is None or not (entry / MARK).is_file():
        raise BuildError(f"`{command}` finished without a complete entry ({entry})")
    return entry


def entry(artefact: str, *args: str) -> tuple[Path, bool]:
    """Where ``artefact`` built with ``args`` is (or would be) cached, and whether that entry
    is complete; builds nothing."""
    rc, err, found = _run(artefact, args, query=True, stream=False, timeout=60)
    if rc not in (0, NOT_BUILT) or found is None:
        raise BuildError(f"asking where {artefact} is built failed (exit {rc}): {err.strip()}")
    return found, rc == 0


def lookup(artefact: str, *args: str) -> Path | None:
    """The entry of ``artefact`` when it is complete, else None; builds nothing."""
    found, complete = entry(artefact, *args)
    return found if complete else None


def keep_seconds() -> float:
    raw = os.environ.get(KEEP_DAYS_ENV, str(DEFAULT_KEEP_DAYS))
    try:
        days = int(raw)
    except ValueError:
        days = -1
    if days < 0:
        raise BuildError(f"{KEEP_DAYS_ENV}={raw!r} is not a whole number of days (0 or more)")
    return days * 86400.0


def _last_use(entry: Path) -> float | None:
    """When the entry was last built or used: its mark (a folder) or itself (a file)."""
    mark = entry / MARK if entry.is_dir() else entry
    try:
        return mark.stat().st_mtime
    except FileNotFoundError:
        return None


def touch(entry: Path) -> None:
    """Records a use of a complete entry (a folder's mark, or a file entry itself)."""
    mark = entry / MARK if entry.is_dir() else entry
    # A read-only cache still serves; it only forgets the use.
    with contextlib.suppress(OSError):
        os.utime(mark)


def evict(folder: Path, pattern: str, keep: Path, keep_days: float | None = None) -> list[Path]:
    """Removes the entries of ``folder`` matching ``pattern`` that were not used for the keep
    period (``keep_days``, else the setting), never ``keep`` (the current one) and never one
    whose lock another process holds. Returns what it removed."""
    period = keep_seconds() if keep_days is None else keep_days * 86400.0
    limit = time.time() - period
    removed: list[Path] = []
    for entry in sorted(folder.glob(pattern)):
        if entry.suffix == ".lock" or entry == keep:
            continue
        if entry.suffix == ".tmp" and entry.with_suffix("") == keep:
            continue
        used = _last_use(entry)
        if entry.suffix != ".tmp" and used is not None and used >= limit:
            continue
        lock = entry.with_name(entry.name.removesuffix(".tmp") + ".lock")
        with open(lock, "a") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
            if not any(lock.with_suffix(s).exists() for s in ("", ".tmp")):
                lock.unlink(missing_ok=True)
    return removed
