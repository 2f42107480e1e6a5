"""Does NVIDIA's device plugin serve this node? Then the plugin waits instead of serving.

Two drivers handing out the same GPUs double-book them. The sign that a device plugin serves
a node is what the kubelet itself reports: a device plugin that registered for
``nvidia.com/gpu`` (or, with MIG's mixed strategy, ``nvidia.com/mig-<profile>``, or with
time-slicing's renamed resources ``nvidia.com/gpu.shared``) makes the Node's
``status.allocatable`` carry that resource with a count above 0, and the kubelet sets it to 0
as soon as the plugin disconnects (pkg/kubelet/cm/devicemanager, PluginDisconnected). A
label is no such sign: NVIDIA's GPU Operator labels every GPU node
``nvidia.com/gpu.deploy.device-plugin=true`` whether or not its device plugin is enabled.
DRA extended resources (a DeviceClass's ``extendedResourceName``) are not written into the
Node's allocatable, so flexgpu serving ``nvidia.com/gpu`` itself never looks like a device
plugin.

While a device plugin serves the node, the plugin neither registers with the kubelet nor
publishes a slice; it records a Warning Event on the Node saying so, reads the Node again
every ``recheck_s``, and goes on once the count is 0 (or the resource is gone).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from flexgpu.kubelet_plugin.api.kube_api import KubeApi, path_of

log = logging.getLogger(__name__)

# Resource names NVIDIA's device plugin registers (a trailing * is a prefix).
DEVICE_PLUGIN_RESOURCES: Final = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*")
WAITING_REASON: Final = "DevicePluginServesNode"
CLEARED_REASON: Final = "DevicePluginGone"


def _count(quantity: object) -> int:
    """An extended resource's quantity: a whole number (the API server refuses anything
    else for extended resources); anything unreadable counts as 0."""
    try:
        return int(str(quantity))
    except ValueError:
        return 0


def _device_plugin_name(name: str) -> bool:
    return any(
        name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern
        for pattern in DEVICE_PLUGIN_RESOURCES
    )


def device_plugin_resources(node: Mapping[str, Any]) -> dict[str, int]:
    """The device plugin's resources the Node's allocatable offers (count above 0)."""
    status = node.get("status")
    allocatable = status.get("allocatable") if isinstance(status, Mapping) else None
    if not isinstance(allocatable, Mapping):
        return {}
    found = {
        name: _count(value) for name, value in allocatable.items() if _device_plugin_name(name)
    }
    return {name: count for name, count in sorted(found.items()) if count > 0}


def waiting_message(resources: Mapping[str, int]) -> str:
    shown = ", ".join(f"{name}: {count}" for name, count in resources.items())
    return (
        f"a device plugin serves this node (allocatable {shown}): flexgpu publishes no "
        "devices here until that is 0, so no GPU is handed out twice. Turn the device plugin "
        "off on this node (GPU Operator: label the node nvidia.com/gpu.deploy.device-plugin="
        "false), or set kubeletPlugin.devicePluginGuard.enabled=false"
    )


class DevicePluginGuard:
    """Blocks the start-up until no device plugin serves the node. ``waiting`` is the reason
    while it blocks ("" otherwise), for the readiness endpoint."""

    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        record_event: Callable[[str, str, str], None],
        recheck_s: float = 30.0,
    ) -> None:
        self._api = api
        self._node = node_name
        self._record = record_event
        self._recheck_s = recheck_s
        self._stop = threading.Event()
        self.waiting = ""

    def _served_by(self) -> dict[str, int]:
        """The device plugin's resources; {} when the Node could not be read: the check
        fails open, since a plugin restarted during an API outage must still serve the
        kubelet's prepare and unprepare calls for the pods already running here."""
        try:
            node = self._api.request("GET", path_of("api", "v1", "nodes", self._node))
        except Exception as err:
            log.warning(
                "could not read node %s to look for a device plugin, starting anyway: %s",
                self._node,
                err,
            )
            return {}
        return device_plugin_resources(node if isinstance(node, Mapping) else {})

    def wait_until_clear(self) -> bool:
        """Returns True once no device plugin serves the node; False if stopped first."""
        warned: dict[str, int] | None = None
        while not self._stop.is_set():
            resources = self._served_by()
            if not resources:
                if warned is not None:
                    message = "the device plugin no longer serves this node; flexgpu starts"
                    self._record(CLEARED_REASON, message, "Normal")
                    log.info("%s", message)
                self.waiting = ""
                return True
            if resources != warned:
                self.waiting = waiting_message(resources)
                log.warning("%s", self.waiting)
                self._record(WAITING_REASON, self.waiting, "Warning")
                warned = resources
            self._stop.wait(self._recheck_s)
        return False

    def stop(self) -> None:
        self._stop.set()
