"""List-then-watch loops that keep ``ClusterState`` current, one thread per resource.

A listing replaces everything the cache holds of the kind, so deletions that happened while a
watch was down are not kept forever; the watch then resumes from the listing's
resourceVersion, follows bookmarks, and re-lists only when the server says the version is too
old (410 Gone). Errors back off exponentially, so a missing CRD or a lost apiserver costs a
request now and then, not a spin.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Protocol

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from flexgpu.controller.cluster_state import KINDS, ClusterState, Kind
from flexgpu.driver import node_policy
from flexgpu.driver.backoff import Backoff
from flexgpu.driver.names import CRD_GROUP, DRIVER_NAME

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S: Final = 300
FIRST_RETRY_S: Final = 1.0
MAX_BACKOFF_S: Final = 30.0
HTTP_GONE: Final = 410

ListFunction = Callable[..., Any]


class Store(Protocol):
    """Where a reflector puts what it lists and watches (``ClusterState``, or a store of one
    kind of its own)."""

    def replace(self, kind: Kind, objects: Iterable[Mapping[str, Any]]) -> None: ...

    def apply(self, kind: Kind, event: str, obj: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class Source:
    kind: Kind
    list_function: ListFunction


def list_function(kind: Kind, api: client.ApiClient) -> ListFunction:
    """The list call for ``kind``. Pods: only unscheduled ones (the scheduler's own field
    selector), since diagnostics are about pods waiting for a node; a pod that gets a node
    leaves the watch as a deletion, which also ends its tracking. Slices: only ours."""
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    functions: dict[Kind, ListFunction] = {
        "slices": partial(
            resource.list_resource_slice, field_selector=f"spec.driver={DRIVER_NAME}"
        ),
        "classes": resource.list_device_class,
        "claims": resource.list_resource_claim_for_all_namespaces,
        "nodes": core.list_node,
        "pods": partial(core.list_pod_for_all_namespaces, field_selector="spec.nodeName="),
        "policies": partial(
            client.CustomObjectsApi(api).list_cluster_custom_object,
            CRD_GROUP,
            node_policy.VERSION,
            node_policy.PLURAL,
        ),
        "budgets": client.PolicyV1Api(api).list_pod_disruption_budget_for_all_namespaces,
    }
    return functions[kind]


class Reflector:
    def __init__(self, source: Source, state: Store) -> None:
        self.source = source
        self._state = state
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{source.kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            # Unblocks the read the watch thread is waiting in.
            response.close()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = Backoff(FIRST_RETRY_S, MAX_BACKOFF_S)
        while not self._stop.is_set():
            try:
                version: str | None = self._list()
                backoff.reset()
                while not self._stop.is_set() and version is not None:
                    version = self._watch(version)
            except Exception as err:  # the loop must outlive any one failure
                if self._stop.is_set():
                    return
                delay = backoff.next()
                quiet = isinstance(err, client.ApiException) and err.status == 404
                (log.debug if quiet else log.warning)(
                    "watching %s failed (%s); retrying in %.1fs", self.source.kind, err, delay
                )
                self._stop.wait(delay)

    def _list(self) -> str:
        response = self.source.list_function(_preload_content=False)
        body = json.loads(response.data)
        self._state.replace(self.source.kind, body.get("items") or [])
        return str(body["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str | None:
        """Follows events from ``version``; returns where to resume, None to re-list."""
        self._response = self.source.list_function(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _preload_content=False,
        )
        try:
            for line in iter_resp_lines(self._response):
                if self._stop.is_set():
                    return None
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == HTTP_GONE:
                        return None
                    raise client.ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._state.apply(self.source.kind, kind, obj)
        finally:
            response, self._response = self._response, None
            response.close()
            response.release_conn()
        return version


def start_reflectors(
    state: ClusterState,
    client_factory: Callable[[], client.ApiClient],
    extra: Mapping[Kind, Store] | None = None,
) -> list[Reflector]:
    """One reflector per kind, each on a client of its own: a watch holds its connection for
    minutes, and a shared pool would make the others wait for it. ``extra``: kinds kept in
    stores of their own (budgets, where GPU clearing may evict)."""
    stores: list[tuple[Kind, Store]] = [(kind, state) for kind in KINDS]
    stores += list((extra or {}).items())
    reflectors = [
        Reflector(Source(kind, list_function(kind, client_factory())), store)
        for kind, store in stores
    ]
    for reflector in reflectors:
        reflector.start()
    return reflectors
