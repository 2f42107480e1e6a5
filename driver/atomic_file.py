"""Atomic file replacement: readers see either the old content or the new, never a torn write.

Used for the simulated GPU state, and meant for any other on-disk record that must survive a
crash mid-write (checkpoints, CDI specs).
"""

from __future__ import annotations

import contextlib
import os


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
    # Plain strings and os calls: this runs twice per prepare, and pathlib and tempfile cost
    # more CPU than the write itself.
    target = os.fspath(path)
    directory, name = os.path.split(target)
    directory = directory or "."
    # The temp file must live in the target's directory: rename is only atomic within a filesystem.
    fd, tmp_name = _create_temp(directory, name)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync_data:
                os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    if sync_data and sync_directory:
        _fsync_directory(directory)


def _create_temp(directory: str, name: str) -> tuple[int, str]:
    """A new file ``.<name>.<random>.tmp`` in directory (made if missing), opened for writing.
    The random part keeps writers apart that share the folder but not a PID namespace (two
    plugin pods during a rolling update)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    made_directory = False
    while True:
        tmp_name = f"{directory}/.{name}.{os.urandom(6).hex()}.tmp"
        try:
            return os.open(tmp_name, flags, 0o600), tmp_name
        except FileExistsError:
            continue
        except FileNotFoundError:
            if made_directory:
                raise
            os.makedirs(directory, exist_ok=True)
            made_directory = True


def atomic_write_text(
    path: str | os.PathLike[str], text: str, encoding: str = "utf-8", mode: int = 0o644
) -> None:
    """Text flavour of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode(encoding), mode=mode)


def _fsync_directory(directory: str) -> None:
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
