"""Hollow GPU nodes' claim watches and the controller's claim labelling, in one process,
against a real control plane: what bench/node_watch.py measures and
tests/integration/test_claim_node_labels.py checks.

A simulated node runs only the plugin's own watch code for binding conditions: the
controller's Lease (kubelet_plugin/api/claim_scope.py) and the claim watch
(kubelet_plugin/api/watched_objects.py) with the query that scope gives, keeping the claims
``BindingWatch.waits_here`` would keep (any flexgpu device of its pool), each node on a
KubeApi of its own that counts what it receives. The controller's part is its claim
reflector, lease elector and labeller (controller/claim_labels.py), as controller/app.py
wires them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kubernetes import client

from flexgpu.controller.claim_labels import ClaimLabeller
from flexgpu.controller.cluster_state import ClusterState
from flexgpu.controller.leader import LeaseElector
from flexgpu.controller.reflector import Reflector, Source, list_function
from flexgpu.driver.claim_node_label import CLAIM_NODE_LABEL, labels_live
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.kubelet_plugin.agents.binding_watch import CLAIMS
from flexgpu.kubelet_plugin.api.claim_scope import WIDEN_AFTER_S, ClaimScope
from flexgpu.kubelet_plugin.api.kube_api import KubeApi, WatchStream
from flexgpu.kubelet_plugin.api.watched_objects import WatchedObjects

LEASE_NAMESPACE = "default"
LEASE_NAME = "bench-flexgpu-controller"


class _CountingResponse:
    """Stands in for a watch's HTTP response and counts the bytes of each line read."""

    def __init__(self, response: Any, counter: Callable[[], Counters]) -> None:
        self._response = response
        self._counter = counter  # looked up per line: reset() starts new counters

    def readline(self, limit: int = -1) -> bytes:
        line: bytes = self._response.readline(limit)
        if line.strip():
            self._counter().add(len(line), line.startswith(b'{"type":"BOOKMARK"'))
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events = 0  # object events: ADDED, MODIFIED, DELETED
        self.bookmarks = 0
        self.bytes = 0  # of both

    def add(self, size: int, bookmark: bool) -> None:
        with self._lock:
            if bookmark:
                self.bookmarks += 1
            else:
                self.events += 1
            self.bytes += size


class CountingKubeApi(KubeApi):
    """The plugin's client, also counting watch events, bookmarks apart, and the bytes of
    both (the node receives them all), and the bytes of every list."""

    claim_events: Counters
    lease_events: Counters
    listed_bytes: int

    def reset(self) -> None:
        self.claim_events = Counters()
        self.lease_events = Counters()
        self.listed_bytes = 0
        with self._lock:
            self.sent.clear()

    def requests(self) -> int:
        with self._lock:
            return sum(self.sent.values())

    def watch(self, path: str, query: Mapping[str, str], timeout_s: int = 300) -> WatchStream:
        stream = super().watch(path, query, timeout_s)
        claims = path == CLAIMS
        stream._response = _CountingResponse(  # type: ignore[assignment]
            stream._response, lambda: self.claim_events if claims else self.lease_events
        )
        return stream

    def request_bytes(self, method: str, path: str, **kw: Any) -> bytes:
        data = super().request_bytes(method, path, **kw)
        if method == "GET":
            self.listed_bytes += len(data)
        return data


class HollowNode:
    """One node's binding-conditions claim watch; ``lease`` "" watches every claim (the
    plugin before claims were labelled, or with the controller's Lease not configured)."""

    def __init__(
        self, kubeconfig: Path, name: str, lease: str, widen_after_s: float = WIDEN_AFTER_S
    ) -> None:
        self.name = name
        api = CountingKubeApi.from_kubeconfig(kubeconfig)
        assert isinstance(api, CountingKubeApi)
        self.api = api
        self.api.reset()
        self.scope = ClaimScope(self.api, name, lease, widen_after_s=widen_after_s)
        self.claims: WatchedObjects | None = None

    def keeps(self, claim: Mapping[str, Any]) -> bool:
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
        return any(
            r.get("driver") == DRIVER_NAME and r.get("pool") == self.name
            for r in results.get("results") or []
        )

    def start(self) -> None:
        self.scope.start()
        self.claims = WatchedObjects(
            self.api, CLAIMS, query=self.scope.query(), keep=self.keeps, name=f"{self.name}"
        )
        self.claims.start()

    def query(self) -> dict[str, str]:
        return self.scope.query()

    def stop(self) -> None:
        if self.claims is not None:
            self.claims.stop()
        self.scope.stop()
        self.api.close()


class LabellingController:
    """The controller's labelling, in process: claim reflector, elector, labeller."""

    def __init__(self, api: client.ApiClient, identity: str = "bench-controller-0") -> None:
        self.elector = LeaseElector(
            api, name=LEASE_NAME, namespace=LEASE_NAMESPACE, identity=identity
        )
        self.labeller = ClaimLabeller(
            api, self.elector, synced=lambda: self.state.synced(("claims",))
        )
        self.state = ClusterState(listeners={"claims": self.labeller})
        self.reflector = Reflector(Source("claims", list_function("claims", api)), self.state)
        self._stopped = False

    @property
    def lease(self) -> str:
        return f"{LEASE_NAMESPACE}/{LEASE_NAME}"

    def start(self) -> None:
        self.reflector.start()
        self.elector.start()
        self.labeller.start()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.labeller.stop()
        self.elector.stop(release=True)
        self.reflector.stop()
        self.reflector.join(5)


def claim_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": DRIVER_NAME,
                            "allocationMode": "ExactCount",
                            "count": 1,
                        },
                    }
                ]
            }
        },
    }


def allocation(node: str, device: str = "gpu-0") -> dict[str, Any]:
    """status.allocation as the scheduler writes it for a device of ``node``'s pool."""
    return {
        "devices": {
            "results": [{"request": "gpu", "driver": DRIVER_NAME, "pool": node, "device": device}]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }


def allocated_claim(api: client.ApiClient, namespace: str, name: str, node: str) -> None:
    """Creates a claim and allocates it on ``node`` (two claim changes), as the scheduler
    does for a pod."""
    resource: Any = client.ResourceV1Api(api)
    created = resource.create_namespaced_resource_claim(namespace, claim_body(name))
    body = client.ApiClient().sanitize_for_serialization(created)
    body["status"] = {"allocation": allocation(node)}
    resource.replace_namespaced_resource_claim_status(name, namespace, body)


def labelled(api: client.ApiClient, namespace: str, name: str) -> bool:
    read = client.ResourceV1Api(api).read_namespaced_resource_claim(name, namespace)
    return CLAIM_NODE_LABEL in ((read.metadata and read.metadata.labels) or {})


def lease_marked(
    api: client.ApiClient, namespace: str = LEASE_NAMESPACE, name: str = LEASE_NAME
) -> bool:
    """Whether the controller's Lease tells nodes that claims are labelled."""
    try:
        read = client.CoordinationV1Api(api).read_namespaced_lease(name, namespace)
    except client.ApiException as err:
        if err.status == 404:  # not created yet
            return False
        raise
    return labels_live(client.ApiClient().sanitize_for_serialization(read))
