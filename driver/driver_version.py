"""Which NVIDIA driver a driver root holds now, read from its files alone.

The driver installs NVML as ``libnvidia-ml.so.<version>`` and points ``libnvidia-ml.so.1`` at
it, so the link's target names the version without loading anything; the target's identity
(device, inode, size, modification time) tells a reinstall of the same version apart. Both are
a few system calls, cheap enough to read on every prepare. A root that is being replaced (no
link yet, a link to nothing, a name without a version) reads as None: not a driver to write
specs for.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from flexgpu.driver.preflight import LIBRARY_DIRS, NVML_LIBRARY

_VERSIONED = re.compile(r"^libnvidia-ml\.so\.(?P<version>\d+(?:\.\d+)+)$")


@dataclass(frozen=True)
class DriverFingerprint:
    """The installed driver: its version and the file that carries it."""

    version: str
    library: str  # the versioned NVML file, as the plugin sees it
    identity: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def read_fingerprint(driver_root: Path) -> DriverFingerprint | None:
    """The driver installed under ``driver_root`` now, or None while there is none whole."""
    root = os.fspath(driver_root)
    for folder in LIBRARY_DIRS:
        link = f"{root}/{folder}/{NVML_LIBRARY}"
        try:
            st = os.stat(link)  # through the links: fails on a link to nothing
            # One readlink names the version where the link is the installer's (one hop);
            # anything else is resolved whole.
            target = os.path.join(os.path.dirname(link), os.readlink(link))
            if _VERSIONED.match(os.path.basename(target)) is None:
                target = os.path.realpath(link, strict=True)
        except OSError:
            continue  # absent here, not a link, or a link to nothing (a swap half-way)
        match = _VERSIONED.match(os.path.basename(target))
        if match is None:
            return None
        return DriverFingerprint(
            match["version"], target, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        )
    return None


def version_of(fingerprint: DriverFingerprint | None) -> str:
    """The version for messages: ``none installed`` for a root without a whole driver."""
    return "none installed" if fingerprint is None else fingerprint.version
