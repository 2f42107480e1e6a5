"""Records Kubernetes Events on the plugin's Node, so admins see what the plugin did."""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Callable
from typing import Any

from flexgpu.kubelet_plugin.api.kube_api import KubeApi, path_of

log = logging.getLogger(__name__)

# What records a Warning Event on the Node: (reason, message). NodeEventRecorder is one.
NodeEventSink = Callable[[str, str], None]


class NodeEventRecorder:
    def __init__(self, api: KubeApi, node_name: str, component: str = "flexgpu-kubelet-plugin"):
        self._api = api
        self._node = node_name
        self._component = component

    def __call__(self, reason: str, message: str, event_type: str = "Warning") -> None:
        now = datetime.datetime.now(datetime.UTC)
        body: Any = {
            "metadata": {"name": f"{self._node}.{uuid.uuid4().hex[:12]}", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": self._node, "uid": self._node},
            "reason": reason,
            "message": message[:1024],
            "type": event_type,
            "source": {"component": self._component, "host": self._node},
            "firstTimestamp": now.isoformat(),
            "lastTimestamp": now.isoformat(),
            "count": 1,
        }
        try:
            self._api.request(
                "POST", path_of("api", "v1", "namespaces", "default", "events"), body=body
            )
        except Exception as err:  # an Event is best effort; never fail the caller
            log.warning("could not record event %s on node %s: %s", reason, self._node, err)
