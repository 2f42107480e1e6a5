from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kubelet_plugin.prepare_lock import LockTimeout, PrepareLock

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


def test_not_reentrant_on_the_same_object(tmp_path: Path) -> None:
    lock = PrepareLock(tmp_path / "prepare.lock")
    with lock, pytest.raises(RuntimeError, match="already held"):
        lock.acquire()
    lock.acquire()  # released by the with block
    lock.release()
