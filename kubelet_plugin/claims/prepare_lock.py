"""Locks for prepare and unprepare: one per node state a claim touches, shared by every thread
and by a second plugin process.

- The node lock, ``<data dir>/prepare.lock``: every prepare/unprepare holds it shared, start-up
  reconcile and checkpoint migration hold it exclusive. Plugins of schema version 1 take it
  exclusive for each operation, so during a rolling update from one of them the two never
  overlap.
- A claim lock (in-process): one operation per claim at a time in this process.
- Resource locks, ``<data dir>/locks/<key>.lock``, e.g. ``gpu-3``: everything that changes a
  physical GPU (its MIG layout, MPS daemon, time-slice, exclusive use) holds its lock, so work
  on one GPU is serial while work on different GPUs runs in parallel. A caller takes all its
  keys at once, in sorted order, after its claim lock and never the other way round: no
  deadlock.

Each resource lock is a thread lock (cheap waits inside the process) followed by a flock on
the key's file (the other process). A flock belongs to its open file description, so every
acquisition opens the file anew.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

LOCKS_FOLDER = "locks"


class LockTimeout(TimeoutError):
    """The lock stayed held by someone else for longer than the timeout."""


class _Held:
    """A lock held for a ``with`` block: subclasses say how it is taken and let go. Plain
    classes rather than generator context managers: several are taken per prepare."""

    __slots__ = ()

    def acquire(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class _KeyedThreadLocks:
    """One threading.Lock per key, alive while anyone holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    def hold(
        self, key: str, timeout: float | None, on_wait: Callable[[str], None] | None
    ) -> _HeldKey:
        return _HeldKey(self, key, timeout, on_wait)

    def _join(self, key: str) -> threading.Lock:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        return lock

    def _leave(self, key: str) -> None:
        with self._guard:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class _HeldKey(_Held):
    """The key's thread lock."""

    __slots__ = ("_key", "_lock", "_locks", "_on_wait", "_timeout")

    def __init__(
        self,
        locks: _KeyedThreadLocks,
        key: str,
        timeout: float | None,
        on_wait: Callable[[str], None] | None,
    ) -> None:
        self._locks = locks
        self._key = key
        self._timeout = timeout
        self._on_wait = on_wait
        self._lock: threading.Lock | None = None

    def acquire(self) -> None:
        lock = self._locks._join(self._key)
        try:
            if not lock.acquire(blocking=False):
                if self._on_wait is not None:
                    self._on_wait(self._key)
                timeout = self._timeout
                if not lock.acquire(timeout=-1 if timeout is None else timeout):
                    raise LockTimeout(
                        f"lock {self._key} still held by another operation after {timeout:g}s"
                    )
        except BaseException:
            self._locks._leave(self._key)
            raise
        self._lock = lock

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
            self._locks._leave(self._key)


def _open_lock_file(path: str) -> int | None:
    """The file's descriptor; None when it cannot be created because the disk is full (then
    only this process is excluded: unprepare, which frees space, must still work)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        try:
            return os.open(path, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return os.open(path, flags, 0o600)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT) and not os.path.exists(path):
            log.warning(
                "cannot create lock file %s (%s): locking within this process only", path, err
            )
            return None
        raise


def _flock(fd: int, path: str, operation: int, timeout: float | None) -> None:
    if timeout is None:
        fcntl.flock(fd, operation)
        return
    # flock has no timeout of its own: poll non-blocking with a growing pause.
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LockTimeout(
                    f"lock {path} still held by another prepare/unprepare after {timeout:g}s"
                ) from None
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.1)


class _FileLock(_Held):
    """A flock on path (shared or exclusive, by operation)."""

    __slots__ = ("_fd", "_operation", "_path", "_timeout")

    def __init__(self, path: str, operation: int, timeout: float | None) -> None:
        self._path = path
        self._operation = operation
        self._timeout = timeout
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = _open_lock_file(self._path)
        if fd is None:
            return
        try:
            _flock(fd, self._path, self._operation, self._timeout)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock


class PrepareLock:
    """The node lock at ``path`` and the claim and resource locks beside it.

    ``with lock:`` (or acquire/release) holds the node lock exclusive; per thread, not
    re-entrant. ``on_wait(key)`` is called when an operation has to wait for a claim or
    resource lock another thread holds (tests use it to prove that it waits).
    """

    def __init__(
        self,
        path: Path,
        timeout: float | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.locks_dir = path.parent / LOCKS_FOLDER
        # Strings for the per-operation opens (pathlib is slow on this path).
        self._path = os.fspath(path)
        self._locks_dir = os.fspath(self.locks_dir)
        self.timeout = timeout
        self.on_wait = on_wait
        self._claims = _KeyedThreadLocks()
        self._resources = _KeyedThreadLocks()
        self._held = threading.local()

    # -- node lock -----------------------------------------------------------------------
    def acquire(self) -> None:
        if getattr(self._held, "exclusive", None) is not None:
            raise RuntimeError(f"lock {self.path} is already held by this thread")
        held = _FileLock(self._path, fcntl.LOCK_EX, self.timeout)
        held.acquire()
        self._held.exclusive = held

    def release(self) -> None:
        held = getattr(self._held, "exclusive", None)
        self._held.exclusive = None
        if held is not None:
            held.release()

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

    def operation(self) -> contextlib.AbstractContextManager[None]:
        """The node lock, shared: any number of operations, but no start-up reconcile."""
        return _FileLock(self._path, fcntl.LOCK_SH, self.timeout)

    # -- claim and resource locks --------------------------------------------------------
    def claim(self, uid: str) -> contextlib.AbstractContextManager[None]:
        return self._claims.hold(f"claim {uid}", self.timeout, self.on_wait)

    def resources(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        """Every key's lock, taken in sorted order."""
        held: list[_Held] = []
        for key in sorted(set(keys)):
            held.append(self._resources.hold(key, self.timeout, self.on_wait))
            held.append(_FileLock(f"{self._locks_dir}/{key}.lock", fcntl.LOCK_EX, self.timeout))
        return _All(held)


class _All(_Held):
    """Takes the locks in order and lets them go in reverse; a failure to take one releases
    those already taken."""

    __slots__ = ("_entered", "_locks")

    def __init__(self, locks: list[_Held]) -> None:
        self._locks = locks
        self._entered = 0

    def acquire(self) -> None:
        try:
            for lock in self._locks:
                lock.acquire()
                self._entered += 1
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        while self._entered:
            self._entered -= 1
            self._locks[self._entered].release()


def gpu_key(index: int) -> str:
    """The resource key of a physical GPU (covers its MIG layout, MPS daemon and
    time-slice, and the exclusive use of the GPU and of its MIG devices)."""
    return f"gpu-{index}"
