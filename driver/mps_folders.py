"""An MPS daemon's folders on the host, and how to tell that the daemon runs, trusting nothing
a workload can write.

Clients mount the daemon's pipe folder and its shared-memory folder read-write, so whatever
is in them when a daemon is (re)started may be a workload's: a ``control`` FIFO of its own, a
symlink to a host file, a pid file naming any process. So a daemon is started only in folders
emptied and given back to the daemon's user (``reset_folder``), and it is found running by
its process (``control_daemon_running``), never through its pid file. The folders are
emptied in place rather than replaced: a client of a daemon that ended keeps its bind mount
of the same folder and reaches the restarted daemon there. Filesystem only: no API, no GPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

__all__ = [
    "CONTROL_PROGRAM",
    "FOLDER_MODES",
    "control_daemon_pid",
    "control_daemon_running",
    "control_pipe_problem",
    "reset_folder",
]

CONTROL_PROGRAM = "nvidia-cuda-mps-control"
# pipe: clients connect to what the daemon creates there; log: the daemon's alone; shm: every
# client and server writes there, like the host's /dev/shm (sticky: none removes another's).
FOLDER_MODES = {"pipe": 0o755, "log": 0o700, "shm": 0o1777}


def reset_folder(folder: Path, mode: int) -> None:
    """Makes ``folder`` an empty directory owned by this process's user with ``mode``.
    Symlinks inside are removed, never followed; a symlink or file in place of the folder is
    replaced by a directory. Safe to repeat after a kill at any point."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        folder.unlink()
    folder.mkdir(mode=mode, exist_ok=True)
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)  # removes symlinks inside, never follows them
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
    # A root client may have changed the folder's owner or mode (it is a mount point it
    # cannot remove); lchown/chmod on the folder itself, which is no symlink now.
    if os.geteuid() == 0:
        os.lchown(folder, 0, 0)
    os.chmod(folder, mode, follow_symlinks=False)


def control_daemon_running(pipe_dir: str, proc_root: Path = Path("/proc")) -> bool:
    """Whether an MPS control daemon serving ``pipe_dir`` runs (``control_daemon_pid``)."""
    return control_daemon_pid(pipe_dir, proc_root) is not None


def control_daemon_pid(pipe_dir: str, proc_root: Path = Path("/proc")) -> int | None:
    """The MPS control daemon serving ``pipe_dir``: a process of this user, in this process's
    root filesystem (a container's process has another), running the control program with
    ``CUDA_MPS_PIPE_DIRECTORY`` set to ``pipe_dir``. Needs the host's PID namespace to see a
    daemon started earlier (the chart's plugin has it)."""
    wanted = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    try:
        own_root = os.stat(proc_root / "self" / "root")
    except OSError:
        return None
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.geteuid():
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")[:2]
            if not any(os.path.basename(a) == CONTROL_PROGRAM.encode() for a in argv):
                continue
            root = os.stat(entry / "root")
            if (root.st_dev, root.st_ino) != (own_root.st_dev, own_root.st_ino):
                continue
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return None


def control_pipe_problem(pipe_dir: str) -> str | None:
    """Why the daemon's control pipe must not be written to, or ``None``: the plugin writes
    commands there as root, and clients can replace it (a symlink would turn the write into
    one to any file). It must be a FIFO of this process's user, not a symlink."""
    path = Path(pipe_dir) / "control"
    try:
        info = path.lstat()
    except FileNotFoundError:
        return f"{path} does not exist"
    if not stat.S_ISFIFO(info.st_mode):
        return f"{path} is not a FIFO (a client may have replaced it)"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to user {info.st_uid}, not the daemon's (a client made it)"
    return None
