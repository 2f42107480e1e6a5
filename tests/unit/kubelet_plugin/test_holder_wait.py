"""Prepare waits briefly for claims that hold its devices and are being unprepared: a claim
whose GPU is still prepared for a claim that the kubelet unprepares a moment later (a pod
deleted without grace) is prepared once that unprepare is done, in the same call, for an
exclusive GPU, a share that did not fit and a shared GPU of another namespace; a holder that
stays is refused after the wait with the usual message; no more than two calls wait at once,
so the plugin's workers stay free for the unprepares that end the waits."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flexgpu.kubelet_plugin.claims.holder_wait import HolderWait
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef, PrepareResult
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.prepare_support import (
    SHARED_GPU,
    ClaimTable,
    Node,
    device,
    share,
)

GPU = "gpu-0"
SHARED = f"gpu-{SHARED_GPU}"


def _node(tmp_path: Path, wait_s: float = 10.0) -> Node:
    return Node(tmp_path, ClaimTable(), holder_wait_s=wait_s)


def _prepare_while_unpreparing(node: Node, old: ClaimRef, new: ClaimRef) -> PrepareResult:
    """Prepares ``new`` while, on another thread, the kubelet unprepares ``old`` once the
    prepare has started waiting (the order a grace-less pod deletion gives)."""
    assert node.preparer.prepare([old])[old.uid].error == ""
    waiting = threading.Event()
    original = node.preparer.holders.until_one_leaves

    def noting(holders: object, deadline: float) -> bool:
        waiting.set()
        return original(holders, deadline)  # type: ignore[arg-type]

    node.preparer.holders.until_one_leaves = noting  # type: ignore[method-assign]
    with ThreadPoolExecutor(2) as pool:
        prepared = pool.submit(node.preparer.prepare, [new])
        assert waiting.wait(10), "prepare did not wait for the holder"
        assert node.preparer.unprepare([old])[old.uid].error == ""
        return prepared.result(timeout=20)[new.uid]


def test_an_exclusive_gpu_is_prepared_once_its_holder_is_unprepared(tmp_path: Path) -> None:
    node = _node(tmp_path)
    old = node.table.add("old", device(GPU))
    new = node.table.add("new", device(GPU))
    result = _prepare_while_unpreparing(node, old, new)
    assert result.error == ""
    assert [d.device_name for d in result.devices] == [GPU]
    assert node.preparer.holders.waited == 1
    assert node.store.get(old.uid) is None and node.store.get(new.uid) is not None


def test_a_share_that_did_not_fit_is_prepared_once_the_old_share_is_gone(tmp_path: Path) -> None:
    node = _node(tmp_path)
    old = node.table.add("old", share(SHARED, "s1", "60Gi"))
    new = node.table.add("new", share(SHARED, "s2", "60Gi"))
    assert _prepare_while_unpreparing(node, old, new).error == ""


def test_another_namespaces_gpu_is_prepared_once_its_claims_are_gone(tmp_path: Path) -> None:
    node = _node(tmp_path)
    old = node.table.add("old", share(SHARED, "s1", "8Gi"), namespace="team-a")
    new = node.table.add("new", share(SHARED, "s2", "8Gi"), namespace="team-b")
    result = _prepare_while_unpreparing(node, old, new)
    assert result.error == ""


def test_a_holder_that_stays_is_refused_after_the_wait(tmp_path: Path) -> None:
    node = _node(tmp_path, wait_s=0.3)
    held = node.table.add("held", device(GPU))
    other = node.table.add("other", device(GPU))
    assert node.preparer.prepare([held])[held.uid].error == ""
    start = time.monotonic()
    error = node.preparer.prepare([other])[other.uid].error
    assert f"device {GPU} is already prepared for claim ns/held" in error
    assert time.monotonic() - start >= 0.3
    assert node.store.get(other.uid) is None and node.store.get(held.uid) is not None


def test_no_more_than_two_calls_wait_at_once() -> None:
    """Waiting holds a worker of the plugin's DRA server (4): the third waiter is answered
    at once, leaving workers for the unprepares."""
    release = threading.Event()
    polled: set[str] = set()

    def still_held(uid: str) -> bool:
        polled.add(threading.current_thread().name)
        return not release.is_set()

    wait = HolderWait(still_held, wait_s=10, waiters=2)

    def waiter() -> bool:
        return wait.until_one_leaves(["uid-held"], wait.deadline())

    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(waiter) for _ in range(2)]
        wait_for(lambda: len(polled) == 2, timeout_s=5, what="both calls waiting")
        begin = time.monotonic()
        assert not wait.until_one_leaves(["uid-held"], wait.deadline())
        assert time.monotonic() - begin < 1, "the third call was not answered at once"
        release.set()
        assert all(f.result(timeout=5) for f in waiting)
    assert wait.waited == 2


def test_a_call_with_nothing_to_wait_for_or_past_its_deadline_does_not_wait() -> None:
    wait = HolderWait(lambda uid: True, wait_s=10)
    assert not wait.until_one_leaves([], wait.deadline())
    assert not wait.until_one_leaves(["uid-held"], time.monotonic() - 1)
    assert wait.waited == 0
