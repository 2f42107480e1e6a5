"""Debian packages as image content: fetched with `apt-get download` (no root, no install on
this machine) into the tool cache, unpacked with `dpkg -x`."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path


class DebError(RuntimeError):
    pass


def _run(argv: Sequence[str], cwd: Path) -> str:
    proc = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DebError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}) in {cwd}:\n"
            f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
        )
    return proc.stdout


def fetch(packages: Sequence[str], cache: Path) -> list[Path]:
    """The .deb file of each package (the candidate version apt knows), downloading the
    missing ones into ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    debs: list[Path] = []
    missing: list[str] = []
    for pkg in packages:
        found = sorted(cache.glob(f"{pkg}_*_*.deb"))
        if found:
            debs.append(found[-1])
        else:
            missing.append(pkg)
    if missing:
        try:
            _run(["apt-get", "download", *missing], cache)
        except FileNotFoundError as err:
            raise DebError(
                "apt-get is needed to fetch Debian packages for the node's images "
                f"({', '.join(missing)})"
            ) from err
        for pkg in missing:
            found = sorted(cache.glob(f"{pkg}_*_*.deb"))
            if not found:
                raise DebError(f"apt-get download {pkg} left no {pkg}_*.deb in {cache}")
            debs.append(found[-1])
    return debs


def unpack(debs: Sequence[Path], rootfs: Path) -> None:
    rootfs.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        _run(["dpkg-deb", "-x", str(deb), str(rootfs)], rootfs)
