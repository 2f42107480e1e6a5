"""The device-plugin guard (kubelet_plugin/api/device_plugin_guard.py): the plugin starts
only where no device plugin's resources are allocatable, whatever the node's labels say, and
says why it waits in an Event and on /readyz."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from flexgpu.kubelet_plugin.api.device_plugin_guard import (
    CLEARED_REASON,
    WAITING_REASON,
    DevicePluginGuard,
    device_plugin_resources,
)
from flexgpu.kubelet_plugin.api.kube_api import ApiError
from flexgpu.kubelet_plugin.config_flags import load_config
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi

NODE = "gpu-node-1"
PATH = f"/api/v1/nodes/{NODE}"
# As NVIDIA's GPU Operator leaves a node with its device plugin turned off: every deploy
# label "true", no nvidia.com/gpu in allocatable.
OPERATOR_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.deploy.device-plugin": "true",
    "nvidia.com/gpu.deploy.driver": "true",
    "nvidia.com/gpu.deploy.container-toolkit": "true",
    "nvidia.com/gpu-driver-upgrade-state": "upgrade-done",
}


def _node(allocatable: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": NODE, "labels": labels or {}},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi", **allocatable}},
    }


@pytest.mark.parametrize(
    ("allocatable", "found"),
    [
        ({}, {}),
        ({"nvidia.com/gpu": "8"}, {"nvidia.com/gpu": 8}),
        # The kubelet sets 0 the moment the device plugin disconnects.
        ({"nvidia.com/gpu": "0"}, {}),
        ({"nvidia.com/mig-1g.10gb": "7", "nvidia.com/gpu": "0"}, {"nvidia.com/mig-1g.10gb": 7}),
        ({"nvidia.com/gpu.shared": "16"}, {"nvidia.com/gpu.shared": 16}),
        # NVIDIA's network device plugins share the prefix, not the names.
        ({"nvidia.com/rdma_shared_device_a": "63", "nvidia.com/gpux": "1"}, {}),
        ({"example.com/gpu": "4"}, {}),
    ],
)
def test_which_allocatable_resources_mean_a_device_plugin(
    allocatable: dict[str, str], found: dict[str, int]
) -> None:
    assert device_plugin_resources(_node(allocatable)) == found


def test_broken_node_objects_mean_no_device_plugin() -> None:
    assert device_plugin_resources({}) == {}
    assert device_plugin_resources({"status": {"allocatable": "x"}}) == {}
    assert device_plugin_resources({"status": {"allocatable": {"nvidia.com/gpu": "lots"}}}) == {}


class Events:
    def __init__(self) -> None:
        self.recorded: list[tuple[str, str, str]] = []

    def __call__(self, reason: str, message: str, event_type: str) -> None:
        self.recorded.append((reason, message, event_type))


def _guard(api: FakeKubeApi, events: Events) -> DevicePluginGuard:
    return DevicePluginGuard(api, NODE, events, recheck_s=0.01)  # type: ignore[arg-type]


def test_an_operator_node_without_its_device_plugin_starts_at_once() -> None:
    """The Operator's label says device-plugin=true, but nothing is allocatable: no wait."""
    api, events = FakeKubeApi(), Events()
    api.put_object(PATH, _node({}, OPERATOR_LABELS))
    guard = _guard(api, events)
    assert guard.wait_until_clear() is True
    assert events.recorded == [] and guard.waiting == ""
    assert api.count("GET") == 1


def test_a_node_a_device_plugin_serves_waits_with_an_event_until_it_stops() -> None:
    api, events = FakeKubeApi(), Events()
    api.put_object(PATH, _node({"nvidia.com/gpu": "8"}, OPERATOR_LABELS))
    guard = _guard(api, events)
    outcome: list[bool] = []
    waiter = threading.Thread(target=lambda: outcome.append(guard.wait_until_clear()))
    waiter.start()
    wait_for(lambda: api.count("GET") >= 3, what="the guard to read the Node again")
    assert outcome == []
    assert "allocatable nvidia.com/gpu: 8" in guard.waiting
    assert "nvidia.com/gpu.deploy.device-plugin=false" in guard.waiting
    # One Event for one state, however often the Node is read.
    assert [(r, t) for r, _, t in events.recorded] == [(WAITING_REASON, "Warning")]
    api.put_object(PATH, _node({"nvidia.com/gpu": "0"}, OPERATOR_LABELS))
    waiter.join(5)
    assert outcome == [True] and guard.waiting == ""
    assert [(r, t) for r, _, t in events.recorded] == [
        (WAITING_REASON, "Warning"),
        (CLEARED_REASON, "Normal"),
    ]


def test_stop_ends_the_wait() -> None:
    api, events = FakeKubeApi(), Events()
    api.put_object(PATH, _node({"nvidia.com/mig-1g.10gb": "2"}))
    guard = _guard(api, events)
    outcome: list[bool] = []
    waiter = threading.Thread(target=lambda: outcome.append(guard.wait_until_clear()))
    waiter.start()
    wait_for(lambda: bool(guard.waiting), what="the guard to wait")
    guard.stop()
    waiter.join(5)
    assert outcome == [False]


def test_an_unreadable_node_fails_open() -> None:
    """A plugin restarted during an API outage must still serve the kubelet's calls for the
    pods already on the node, so a failed read does not hold the start."""
    api, events = FakeKubeApi(), Events()
    api.fail_next.append(ApiError(503, "ServiceUnavailable", "etcd is away"))
    assert _guard(api, events).wait_until_clear() is True
    assert events.recorded == []


def test_the_guard_settings() -> None:
    assert load_config(["--node-name=n"], {}).device_plugin_guard == "on"
    config = load_config(
        ["--node-name=n"],
        {"FLEXGPU_DEVICE_PLUGIN_GUARD": "off", "FLEXGPU_DEVICE_PLUGIN_RECHECK": "5s"},
    )
    assert (config.device_plugin_guard, config.device_plugin_recheck_seconds) == ("off", 5.0)
    with pytest.raises(Exception, match="device_plugin_guard"):
        load_config(["--node-name=n", "--device-plugin-guard=maybe"], {})
