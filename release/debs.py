"""Debian packages as image content: fetched with `apt-get download` (no install on this
machine) into the tool cache, unpacked with `dpkg -x`. The machine's own architecture comes
from its package lists; another (arm64 on an amd64 machine) from package lists of that
architecture which apt keeps in the tool cache, read from the machine's package sources and
checked against its archive keys, so the machine's apt configuration is never changed."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

# The foreign lists are refreshed when older than this: the point release moves slowly, and
# a refresh costs a minute.
LISTS_MAX_AGE_S = 86400.0


class DebError(RuntimeError):
    pass


def _run(argv: Sequence[str], cwd: Path) -> str:
    try:
        proc = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as err:
        raise DebError(
            f"{argv[0]} is needed to fetch and unpack the images' Debian packages"
        ) from err
    if proc.returncode != 0:
        raise DebError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}) in {cwd}:\n"
            f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
        )
    return proc.stdout


@functools.cache
def host_arch() -> str:
    """The machine's Debian architecture (amd64, arm64)."""
    return _run(["dpkg", "--print-architecture"], Path("/")).strip()


def _foreign_apt(arch: str, state: Path) -> list[str]:
    """apt-get options that read package lists of ``arch`` kept under ``state``, refreshing
    them when missing or stale."""
    lists = state / "lists"
    options = [
        "-o", f"APT::Architecture={arch}",
        "-o", f"APT::Architectures::={arch}",
        "-o", f"Dir::State::Lists={lists}",
        "-o", f"Dir::State::status={state / 'status'}",
        "-o", f"Dir::Cache={state / 'cache'}",
    ]  # fmt: skip
    stamp = state / "updated"
    fresh = stamp.exists() and time.time() - stamp.stat().st_mtime < LISTS_MAX_AGE_S
    if not fresh:
        (lists / "partial").mkdir(parents=True, exist_ok=True)
        (state / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        (state / "status").touch()
        _run(["apt-get", *options, "update"], state)
        if not any(lists.glob(f"*binary-{arch}_Packages*")):
            raise DebError(
                f"the machine's package sources list no {arch} packages "
                f"(no binary-{arch} Packages index under {lists})"
            )
        stamp.touch()
    return options


def cache_folder(cache: Path, arch: str | None) -> Path:
    """Where the .deb files of ``arch`` are kept: ``cache`` for the machine's own."""
    return cache if arch in (None, host_arch()) else cache.with_name(f"{cache.name}-{arch}")


def fetch(packages: Sequence[str], cache: Path, arch: str | None = None) -> list[Path]:
    """The .deb file of each package for ``arch`` (default: this machine's), the candidate
    version apt knows, downloading the missing ones into the cache."""
    folder = cache_folder(cache, arch)
    folder.mkdir(parents=True, exist_ok=True)
    debs: list[Path] = []
    missing: list[str] = []
    for pkg in packages:
        found = sorted(folder.glob(f"{pkg}_*_*.deb"))
        if found:
            debs.append(found[-1])
        else:
            missing.append(pkg)
    if missing:
        with locked(folder / ".lock"):
            # apt takes its own lock on the lists and fails at once where another build
            # holds it: builds of other trees wait here instead.
            options = [] if folder == cache else _foreign_apt(str(arch), folder / ".apt")
            _run(["apt-get", *options, "download", *missing], folder)
        for pkg in missing:
            found = sorted(folder.glob(f"{pkg}_*_*.deb"))
            if not found:
                raise DebError(f"apt-get download {pkg} left no {pkg}_*.deb in {folder}")
            debs.append(found[-1])
    return debs


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path`` (created if missing) while the block runs."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def version(deb: Path) -> str:
    """The package version a .deb file's name carries (``name_version_arch.deb``)."""
    return deb.name.split("_")[1].replace("%3a", ":")


def unpack(debs: Sequence[Path], rootfs: Path) -> None:
    rootfs.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        _run(["dpkg-deb", "-x", str(deb), str(rootfs)], rootfs)
