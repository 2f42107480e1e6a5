"""An MPS daemon's folders on the host, and how to tell that the daemon runs, trusting nothing
a workload can write.

Clients mount the daemon's pipe folder and its shared-memory folder read-write, so whatever
is in them may be a workload's: a ``control`` FIFO of its own, a symlink to a host file, a
pid file naming any process. So:

- before a daemon starts, its pipe folder is emptied (what is there belongs to MPS, and the
  clients of a daemon that ended lost their connection with it) and the symlinks are removed
  from its log and shm folders, never followed (``reset_folder``); the shm folder's files
  stay, as it is also the ``/dev/shm`` of clients that may still run;
- once a daemon stopped with its last claim, its pipe and shm folders are emptied
  (``empty_daemon_folders``), so the next tenant of the GPU finds nothing of the last one;
- a daemon is found running by its process (``control_daemon_pid``), never through its pid
  file, and the plugin writes commands only to a control pipe that is a FIFO of the daemon's
  user (``control_pipe_problem``).

Folders are emptied in place rather than replaced: a client of a daemon that ended keeps its
bind mount of the same folder and reaches the restarted daemon there. Filesystem only.
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
    "empty_daemon_folders",
    "prepare_daemon_folders",
    "reset_folder",
]

CONTROL_PROGRAM = "nvidia-cuda-mps-control"
# pipe: clients connect to what the daemon creates there; log: the daemon's alone; shm: every
# client and server writes there, like the host's /dev/shm (sticky: none removes another's).
FOLDER_MODES = {"pipe": 0o755, "log": 0o700, "shm": 0o1777}


def reset_folder(folder: Path, mode: int, *, links_only: bool = False) -> None:
    """Makes ``folder`` a directory owned by this process's user with ``mode``, emptied, or
    with ``links_only`` rid of its symlinks at any depth. Symlinks are removed, never
    followed; a symlink or file in place of the folder is replaced by a directory. Safe to
    repeat after a kill at any point."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        folder.unlink()
    folder.mkdir(mode=mode, exist_ok=True)
    if links_only:
        _remove_links(folder)
    else:
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


def _remove_links(folder: Path) -> None:
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:  # a link to a folder is listed in dirs, and not entered
            path = os.path.join(top, name)
            if os.path.islink(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def prepare_daemon_folders(pipe_dir: str, log_dir: str, shm_dir: str) -> None:
    """Before a daemon starts (see the module's docstring)."""
    reset_folder(Path(pipe_dir), FOLDER_MODES["pipe"])
    reset_folder(Path(log_dir), FOLDER_MODES["log"], links_only=True)
    reset_folder(Path(shm_dir), FOLDER_MODES["shm"], links_only=True)


def empty_daemon_folders(pipe_dir: str, shm_dir: str) -> None:
    """Once a daemon stopped with its last claim: nothing of its clients stays for the next."""
    reset_folder(Path(pipe_dir), FOLDER_MODES["pipe"])
    reset_folder(Path(shm_dir), FOLDER_MODES["shm"])


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
