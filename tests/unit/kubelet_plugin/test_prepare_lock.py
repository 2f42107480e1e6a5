from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flexgpu.kubelet_plugin.claims.prepare_lock import LockTimeout, PrepareLock
from tests.conftest import wait_for

ROUNDS = 15


def _critical_sections(lock_path: Path, log_path: Path, name: str, go: Any) -> None:
    go.wait()
    for _ in range(ROUNDS):
        with PrepareLock(lock_path), log_path.open("a") as log:
            log.write(f"{name} in\n")
            log.flush()
            time.sleep(0.002)  # let the other process try to get in
            log.write(f"{name} out\n")


def test_two_processes_never_interleave(tmp_path: Path) -> None:
    lock_path, log_path = tmp_path / "data" / "prepare.lock", tmp_path / "log"
    context = multiprocessing.get_context("fork")
    go = context.Event()
    workers = [
        context.Process(target=_critical_sections, args=(lock_path, log_path, name, go))
        for name in ("old-pod", "new-pod")
    ]
    for worker in workers:
        worker.start()
    go.set()
    for worker in workers:
        worker.join(10)
        assert worker.exitcode == 0
    lines = log_path.read_text().splitlines()
    assert len(lines) == 4 * ROUNDS
    for enter, leave in zip(lines[::2], lines[1::2], strict=True):
        assert enter.endswith(" in") and leave == enter.replace(" in", " out"), lines


def _try_lock(lock_path: Path, result: Any) -> None:
    try:
        with PrepareLock(lock_path, timeout=0.1):
            result.value = 1
    except LockTimeout:
        result.value = 2


def test_timeout_while_another_process_holds_it(tmp_path: Path) -> None:
    lock_path = tmp_path / "prepare.lock"
    context = multiprocessing.get_context("fork")
    result = context.Value("i", 0)
    with PrepareLock(lock_path):
        child = context.Process(target=_try_lock, args=(lock_path, result))
        child.start()
        child.join(10)
    assert result.value == 2
    # Released on exit: the next taker gets it at once.
    child = context.Process(target=_try_lock, args=(lock_path, result))
    child.start()
    child.join(10)
    assert result.value == 1


def test_threads_of_one_process_are_excluded_too(tmp_path: Path) -> None:
    lock_path = tmp_path / "prepare.lock"
    errors: list[BaseException] = []

    def contend() -> None:
        try:
            PrepareLock(lock_path, timeout=0.05).acquire()
        except LockTimeout as exc:
            errors.append(exc)

    with PrepareLock(lock_path):
        thread = threading.Thread(target=contend)
        thread.start()
        thread.join(5)
    assert len(errors) == 1 and "still held" in str(errors[0])


def test_not_reentrant_in_one_thread_but_other_threads_wait(tmp_path: Path) -> None:
    lock = PrepareLock(tmp_path / "prepare.lock")
    got_it = threading.Event()

    def other_thread() -> None:
        with lock:  # the same object from another gRPC worker: waits, never raises
            got_it.set()

    with lock:
        with pytest.raises(RuntimeError, match="already held by this thread"):
            lock.acquire()
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert not got_it.is_set()
    thread.join(5)
    assert got_it.is_set()


def test_operations_share_the_node_lock_and_exclude_start_up(tmp_path: Path) -> None:
    lock = PrepareLock(tmp_path / "prepare.lock", timeout=0.05)
    # Two operations at once, while start-up waits.
    with lock.operation(), lock.operation(), pytest.raises(LockTimeout):
        PrepareLock(lock.path, timeout=0.05).acquire()
    with lock, pytest.raises(LockTimeout), lock.operation():
        pass


def _hold_resource(lock_path: Path, key: str, held: Any, release: Any) -> None:
    with PrepareLock(lock_path).resources([key]):
        held.set()
        release.wait(10)


@contextlib.contextmanager
def _held_by_another_process(lock_path: Path, key: str) -> Iterator[None]:
    """While the block runs, a forked process holds the resource lock of key."""
    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    child = context.Process(target=_hold_resource, args=(lock_path, key, held, release))
    child.start()
    try:
        assert held.wait(10)
        yield
    finally:
        release.set()
        child.join(10)


def test_resource_lock_excludes_the_other_process_per_key(tmp_path: Path) -> None:
    lock_path = tmp_path / "data" / "prepare.lock"
    with _held_by_another_process(lock_path, "gpu-0"):
        lock = PrepareLock(lock_path, timeout=0.05)
        with lock.resources(["gpu-1"]):  # another GPU: free
            pass
        with pytest.raises(LockTimeout), lock.resources(["gpu-1", "gpu-0"]):
            pass
        with lock.resources(["gpu-1"]):  # what was taken before the timeout is released
            pass
    with PrepareLock(lock_path, timeout=0.05).resources(["gpu-0"]):
        pass


def test_a_timeout_on_a_later_key_releases_the_keys_already_taken(tmp_path: Path) -> None:
    lock_path = tmp_path / "data" / "prepare.lock"
    with _held_by_another_process(lock_path, "gpu-1"):
        lock = PrepareLock(lock_path, timeout=0.05)
        # gpu-0 is taken first (sorted order), then gpu-1 times out.
        with pytest.raises(LockTimeout), lock.resources(["gpu-1", "gpu-0"]):
            pass
        # Both of gpu-0's locks are free again (either would time out otherwise): this
        # object's thread lock, and the file lock for another holder.
        with lock.resources(["gpu-0"]):
            pass
        with PrepareLock(lock_path, timeout=0.05).resources(["gpu-0"]):
            pass


def test_waiting_for_a_held_key_is_reported(tmp_path: Path) -> None:
    waited: list[str] = []
    lock = PrepareLock(tmp_path / "prepare.lock", on_wait=waited.append)
    done = threading.Event()

    def second() -> None:
        with lock.resources(["gpu-0"]):
            done.set()

    with lock.resources(["gpu-0"]):
        thread = threading.Thread(target=second)
        thread.start()
        wait_for(lambda: waited == ["gpu-0"], 5, 0.005, "the second thread to wait")
        assert not done.is_set()
    thread.join(5)
    assert done.is_set()
