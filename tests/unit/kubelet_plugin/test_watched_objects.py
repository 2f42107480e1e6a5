"""Watched local copies: one LIST, then changes from the watch; a too-old version lists
again, an absent resource type reads as empty; readers never cause a request."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from flexgpu.kubelet_plugin.api.kube_api import ApiError
from flexgpu.kubelet_plugin.api.watched_objects import WatchedObjects
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.fake_kube_api import END, FakeKubeApi

PATH = "/apis/flexgpu.dev/v1alpha1/gpunodepolicies"


def obj(name: str, version: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version, "labels": labels}}


@pytest.fixture
def api() -> FakeKubeApi:
    fake = FakeKubeApi()
    fake.lists[PATH] = [obj("a", "1")]
    return fake


@pytest.fixture
def watched(api: FakeKubeApi) -> Iterator[tuple[WatchedObjects, threading.Event]]:
    changed = threading.Event()
    copy = WatchedObjects(api, PATH, on_change=changed.set, name="policies")  # type: ignore[arg-type]
    copy.start()
    try:
        yield copy, changed
    finally:
        copy.stop()


def next_watch(api: FakeKubeApi) -> queue.Queue[Any]:
    return api.watches.get(timeout=10)


def test_lists_once_then_follows_the_watch(
    api: FakeKubeApi, watched: tuple[WatchedObjects, threading.Event]
) -> None:
    copy, changed = watched
    events = next_watch(api)
    assert copy.synced and changed.is_set()
    assert [o["metadata"]["name"] for o in copy.items()] == ["a"]
    changed.clear()
    events.put(("ADDED", obj("b", "2")))
    events.put(("MODIFIED", obj("a", "3", pool="p")))
    events.put(("DELETED", obj("b", "4")))

    def applied() -> bool:
        a = copy.get("a")
        return copy.get("b") is None and a is not None and a["metadata"]["resourceVersion"] == "3"

    wait_for(applied, what="the three events applied to the copy")
    assert changed.is_set()
    before = len(api.sent)
    for _ in range(100):
        copy.items()
    assert len(api.sent) == before  # reading the copy costs no request


def test_watch_resumes_from_the_last_version_and_lists_again_only_on_410(
    api: FakeKubeApi, watched: tuple[WatchedObjects, threading.Event]
) -> None:
    copy, _ = watched
    events = next_watch(api)
    events.put(("BOOKMARK", {"metadata": {"resourceVersion": "9"}}))
    events.put(END)  # the server ends the watch (its timeout)
    events = next_watch(api)
    assert copy.lists == 1  # resumed without a list
    api.lists[PATH] = [obj("c", "11")]
    events.put(ApiError(410, "Expired", "too old resource version"))
    next_watch(api)
    assert copy.lists == 2
    assert [o["metadata"]["name"] for o in copy.items()] == ["c"]


def test_absent_resource_type_reads_as_empty_and_synced(api: FakeKubeApi) -> None:
    api.lists[PATH] = ApiError(404, "NotFound", "the server could not find the resource")
    copy = WatchedObjects(api, PATH)  # type: ignore[arg-type]
    copy.start()
    try:
        assert copy.wait_synced(10)
        assert copy.items() == []
    finally:
        copy.stop()


def test_errors_are_retried(api: FakeKubeApi) -> None:
    api.fail_next = [OSError("connection refused")]
    copy = WatchedObjects(api, PATH)  # type: ignore[arg-type]
    copy.start()
    try:
        assert copy.wait_synced(10)
        assert copy.get("a") is not None
    finally:
        copy.stop()
