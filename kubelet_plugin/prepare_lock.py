"""An exclusive lock on <data dir>/prepare.lock that serialises prepare and unprepare.

Two plugin processes run side by side during a rolling update and the kubelet may call
either, so the lock is a file lock (flock) rather than a thread lock. Each acquisition opens
the file anew: flock locks belong to the open file description, so this also excludes other
threads of the same process.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType


class LockTimeout(TimeoutError):
    """The lock stayed held by someone else for longer than the timeout."""


class PrepareLock:
    """Context manager: `with PrepareLock(path, timeout=40): ...`. Not re-entrant."""

    _POLL_SECONDS = 0.01
    _MAX_POLL_SECONDS = 0.1

    def __init__(self, path: Path, timeout: float | None = None) -> None:
        self.path = path
        self.timeout = timeout
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            # Closing the last descriptor releases the flock.
            os.close(fd)

    def _lock(self, fd: int) -> None:
        if self.timeout is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        # flock has no timeout of its own: poll non-blocking with a growing pause.
        deadline = time.monotonic() + self.timeout
        pause = self._POLL_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LockTimeout(
                        f"lock {self.path} still held by another prepare/unprepare "
                        f"after {self.timeout:g}s"
                    ) from None
                time.sleep(min(pause, remaining))
                pause = min(pause * 2, self._MAX_POLL_SECONDS)

    def __enter__(self) -> PrepareLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
