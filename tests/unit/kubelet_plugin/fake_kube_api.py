"""An in-memory API server for the plugin's KubeApi: objects by path, resourceVersion
checks on writes, scripted watches, and a log of every request sent."""

from __future__ import annotations

import copy
import queue
from collections.abc import Iterator, Mapping
from typing import Any

from flexgpu.kubelet_plugin.api.kube_api import ApiError

END = object()  # put on a watch's queue: the server ends that watch


class FakeWatch:
    def __init__(self, events: queue.Queue[Any]) -> None:
        self._events = events
        self.closed = False

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        while not self.closed:
            item = self._events.get()
            if item is END or self.closed:
                return
            if isinstance(item, ApiError):
                raise item
            yield item

    def close(self) -> None:
        self.closed = True
        self._events.put(END)


class FakeKubeApi:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.sent: list[tuple[str, str]] = []
        self.bodies: list[tuple[str, str, Any]] = []  # (method, path, body) of each write
        self.fail_next: list[Exception] = []
        # Raised by the next writes (PUT, PATCH) only, reads going through.
        self.fail_writes: list[Exception] = []
        self.version = 100
        self.watches: queue.Queue[queue.Queue[Any]] = queue.Queue()
        self.watched_paths: dict[int, str] = {}  # id of a watch's queue -> its path
        self.lists: dict[str, list[dict[str, Any]] | ApiError] = {}

    # -- helpers for tests -------------------------------------------------------------
    def put_object(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = copy.deepcopy(obj)
        stored.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.objects[path] = stored
        return copy.deepcopy(stored)

    def count(self, verb: str | None = None) -> int:
        return len([v for v, _ in self.sent if verb is None or v == verb])

    # -- KubeApi ---------------------------------------------------------------------------
    def get(self, path: str, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        return self.request("GET", path, query=query)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        self.sent.append((method, path))
        if self.fail_next:
            raise self.fail_next.pop(0)
        if method == "GET" and path in self.lists:
            listed = self.lists[path]
            if isinstance(listed, ApiError):
                raise listed
            return {"metadata": {"resourceVersion": str(self.version)}, "items": listed}
        if method == "POST":
            return self.put_object(f"{path}/{body['metadata']['name']}", body)
        target = path.removesuffix("/status")
        if target not in self.objects:
            raise ApiError(404, "NotFound", f"{target} not found")
        stored = self.objects[target]
        if method == "GET":
            return copy.deepcopy(stored)
        if method in ("PUT", "PATCH"):
            self.bodies.append((method, path, copy.deepcopy(body)))
        if method in ("PUT", "PATCH") and self.fail_writes:
            raise self.fail_writes.pop(0)
        if method == "PUT":
            if body["metadata"].get("resourceVersion") != stored["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", "the object has been modified")
            updated = copy.deepcopy(stored)
            updated["status"] = copy.deepcopy(body.get("status"))
            if path.endswith("/status"):
                _check_claim_status(stored, updated)
            return self.put_object(target, updated)
        if method == "PATCH":
            expected = (body.get("metadata") or {}).get("resourceVersion")
            if expected is not None and expected != stored["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", "the object has been modified")
            updated = copy.deepcopy(stored)
            _merge(updated, body)
            if path.endswith("/status"):
                _check_claim_status(stored, updated)
            return self.put_object(target, updated)
        raise AssertionError(f"unexpected {method} {path}")

    def watch(self, path: str, query: Mapping[str, str], timeout_s: int = 300) -> FakeWatch:
        self.sent.append(("WATCH", path))
        if self.fail_next:
            raise self.fail_next.pop(0)
        events: queue.Queue[Any] = queue.Queue()
        self.watched_paths[id(events)] = path
        self.watches.put(events)
        return FakeWatch(events)


def _check_claim_status(old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """What the API server checks of a ResourceClaim status write from a driver: the
    allocation is unchanged (changing it needs resourceclaims/binding), and every
    status.devices entry names a device of the claim's current allocation."""
    old_status, new_status = old.get("status") or {}, new.get("status") or {}
    if old_status.get("allocation") != new_status.get("allocation"):
        raise ApiError(
            422,
            "Invalid",
            "status.allocation: Forbidden: changing status.allocation or "
            "status.reservedFor requires resource=resourceclaims/binding",
        )
    results = ((new_status.get("allocation") or {}).get("devices") or {}).get("results") or []
    allocated = {
        (r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID")) for r in results
    }
    for i, entry in enumerate(new_status.get("devices") or []):
        key = (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))
        if key not in allocated:
            raise ApiError(
                422,
                "Invalid",
                f"status.devices[{i}]: Invalid value: {entry.get('device')!r}: must be an "
                "allocated device in the claim",
            )


def _merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
