"""A fresh Debian root file system without debootstrap: the .deb files of a package set and
their dependency closure (as this machine's apt resolves it), unpacked with `dpkg-deb -x`,
and a way to run a command chrooted into it. The set-up check runs there to see what a fresh
Debian machine lacks (tests/integration/test_setup_clean_rootfs.py).

Unpacking runs no maintainer scripts: files that postinst scripts or update-alternatives
would make are absent, and dpkg's database is empty, so apt cannot install into it. It is a
file system to look for commands, headers and libraries in, not a system to administer."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from release import debs

DEPENDS_FLAGS = (
    "--recurse",
    "--no-recommends",
    "--no-suggests",
    "--no-conflicts",
    "--no-breaks",
    "--no-replaces",
    "--no-enhances",
)


def required_packages() -> list[str]:
    """Debian's Priority: required set, as this machine's package lists name it: what every
    Debian system (a minimal container image, debootstrap's minbase) starts from."""
    out = subprocess.run(
        ["apt-cache", "dumpavail"], capture_output=True, text=True, check=True
    ).stdout
    found: set[str] = set()
    for stanza in out.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " "
        )
        if fields.get("Priority") == "required" and fields.get("Architecture") in ("amd64", "all"):
            found.add(fields["Package"])
    return sorted(found)


def closure(packages: Sequence[str]) -> list[str]:
    """``packages`` and everything they depend on (pre-depends included), real packages
    only."""
    out = subprocess.run(
        ["apt-cache", "depends", *DEPENDS_FLAGS, *packages],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = {
        line.strip()
        for line in out.splitlines()
        if line and not line.startswith((" ", "<")) and ":" not in line
    }
    return sorted(names)


def add_packages(rootfs: Path, packages: Sequence[str], cache: Path) -> None:
    """Unpacks ``packages`` and their dependency closure into ``rootfs``."""
    debs.unpack(debs.fetch(closure(packages), cache), rootfs)


def chroot_argv(
    rootfs: Path, argv: Sequence[str], binds: Mapping[Path, str], env: Mapping[str, str]
) -> list[str]:
    """``argv`` run chrooted into ``rootfs`` in a mount namespace of its own, with
    ``binds`` (host path -> path inside) mounted read-only and only ``env`` set."""
    q = shlex.quote
    mounts = []
    for host, inside in binds.items():
        target = rootfs / inside.lstrip("/")
        mounts.append(
            f"mkdir -p {q(str(target))} && mount --bind {q(str(host))} {q(str(target))}"
            f" && mount -o remount,bind,ro {q(str(target))}"
        )
    inner = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]
    script = " && ".join([*mounts, f"exec chroot {q(str(rootfs))} {shlex.join(inner)}"])
    return ["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c", script]
