"""The slice publisher's reconcile loop (a driver.loop.Loop) and its watch thread: a failed
pass is counted, kept as last_error and retried until it works; stop() ends both threads."""

from __future__ import annotations

import queue
import threading
import time

from flexgpu.kubelet_plugin.api.kube_api import path_of
from flexgpu.kubelet_plugin.devices.slice_publisher import SLICES, SlicePublisher
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.fake_kube_api import END, FakeKubeApi

NODE = "node-a"


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("slice-")}


def test_a_failed_pass_is_retried_until_it_publishes_and_stop_ends_both_threads() -> None:
    api = FakeKubeApi()
    api.put_object("/version", {"major": "1", "minor": "37"})
    api.lists[SLICES] = []
    publisher = SlicePublisher(api, NODE, resync_interval_s=3600)  # type: ignore[arg-type]
    publisher.set_devices([{"name": "gpu-0"}])  # before start: the first pass runs at once
    publisher.start()
    try:
        # The Node is not there yet: the owner reference cannot be made, the pass fails.
        wait_for(lambda: publisher.failures >= 1, what="a failed reconcile pass")
        assert "not found" in (publisher.last_error or "")
        assert api.count("POST") == 0
        api.put_object(path_of("api", "v1", "nodes", NODE), {"metadata": {"uid": "uid-a"}})
        wait_for(
            lambda: api.count("POST") == 1 and publisher.last_error is None,
            what="the retried pass publishing the slice",
        )
        assert _threads() == {"slice-reconcile", "slice-watch"}
    finally:
        publisher.stop()
    assert _threads() == set()


def test_slice_watches_ended_at_once_are_reopened_with_growing_delays() -> None:
    """A proxy that ends every slice watch as soon as it opens: in 3 s the watch thread opens
    at most 4 (after 0.4-0.8, 0.8-1.6, 1.6-3.2 s), where it reopened in a tight loop before."""
    api = FakeKubeApi()
    api.put_object("/version", {"major": "1", "minor": "37"})
    api.lists[SLICES] = []
    ending = threading.Event()

    def end_every_watch() -> None:
        while not ending.is_set():
            try:
                api.watches.get(timeout=0.05).put(END)
            except queue.Empty:
                continue

    ender = threading.Thread(target=end_every_watch, daemon=True)
    ender.start()
    publisher = SlicePublisher(api, NODE, resync_interval_s=3600)  # type: ignore[arg-type]
    publisher.start()
    try:
        time.sleep(3.0)
        opened = api.count("WATCH")
    finally:
        publisher.stop()
        ending.set()
        ender.join(5)
    assert 2 <= opened <= 4, opened
