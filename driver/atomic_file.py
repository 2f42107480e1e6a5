"""Atomic file replacement: readers see either the old content or the new, never a torn write.

Used for the simulated GPU state, and meant for any other on-disk record that must survive a
crash mid-write (checkpoints, CDI specs).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(
    path: str | os.PathLike[str],
    data: bytes,
    mode: int = 0o644,
    *,
    sync_data: bool = True,
    sync_directory: bool = True,
) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync dir.

    Against a killed process the rename alone is enough: the page cache outlives the process,
    so readers see the old or the new content whatever the syncs. The syncs only matter for a
    kernel crash or power loss. ``sync_directory=False`` skips the directory fsync: after such
    a crash the file may hold its old content. ``sync_data=False`` (which implies no directory
    sync) also skips the file's fsync: after such a crash the file may be old, new, empty or
    torn, so only callers that detect a torn file (a checksum) and whose content is void after
    a reboot anyway should use it."""
    target = Path(path)
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    # The temp file must live in the target's directory: rename is only atomic within a filesystem.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if sync_data:
                os.fsync(handle.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    if sync_data and sync_directory:
        _fsync_directory(directory)


def atomic_write_text(
    path: str | os.PathLike[str], text: str, encoding: str = "utf-8", mode: int = 0o644
) -> None:
    """Text flavour of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode(encoding), mode=mode)


def _fsync_directory(directory: Path) -> None:
    # Without this the rename itself may be lost on power failure.
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        # Some filesystems refuse fsync on directories; the data itself is already synced.
        pass
    finally:
        os.close(dir_fd)
