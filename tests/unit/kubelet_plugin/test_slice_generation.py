"""When the slice publisher bumps its pool's generation: a change that one slice holds is
written in place (one atomic write, generation kept, as upstream's resourceslice controller
does), so a tenant or health change of one GPU rewrites one slice, not the node's pool; a
change spread over several slices, a slice more or less, publish_again, and slices of mixed
generations bump it, and a restarted publisher never goes below what the server has."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flexgpu.kubelet_plugin.api.kube_api import path_of
from flexgpu.kubelet_plugin.devices.slice_publisher import SLICES, SlicePublisher
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi

NODE = "node-a"
PER_SLICE = 128  # devices per slice without taints or counters


class SliceServer(FakeKubeApi):
    """Lists the slices written so far (the fake's lists are otherwise fixed)."""

    def request(
        self, method: str, path: str, *, query: Mapping[str, str] | None = None, **kw: Any
    ) -> dict[str, Any]:
        if method == "GET" and path == SLICES:
            self.sent.append((method, path))
            items = [o for p, o in self.objects.items() if p.startswith(f"{SLICES}/")]
            return {"metadata": {"resourceVersion": str(self.version)}, "items": items}
        if method == "PUT" and path.startswith(f"{SLICES}/"):
            self.sent.append((method, path))
            body = kw["body"]
            stored = self.objects[path]["metadata"]["resourceVersion"]
            assert body["metadata"]["resourceVersion"] == stored, "a write of a stale slice"
            return self.put_object(path, body)
        return super().request(method, path, query=query, **kw)


def devices(count: int, tenant: dict[int, str] | None = None) -> list[Any]:
    tenant = tenant or {}
    return [
        {"name": f"gpu-{i}", "attributes": {"tenant": {"string": tenant.get(i, "")}}}
        for i in range(count)
    ]


def server() -> SliceServer:
    api = SliceServer()
    api.put_object("/version", {"major": "1", "minor": "37"})
    api.put_object(path_of("api", "v1", "nodes", NODE), {"metadata": {"uid": "uid-a"}})
    return api


def generations(api: SliceServer) -> list[int]:
    return sorted(
        o["spec"]["pool"]["generation"] for p, o in api.objects.items() if p.startswith(SLICES)
    )


def writes(api: SliceServer, publisher: SlicePublisher, content: list[Any]) -> int:
    before = api.count("PUT") + api.count("POST")
    publisher.set_devices(content)
    publisher.reconcile_once()
    return api.count("PUT") + api.count("POST") - before


def test_a_change_one_slice_holds_is_written_in_place() -> None:
    api = server()
    publisher = SlicePublisher(api, NODE)  # type: ignore[arg-type]
    assert writes(api, publisher, devices(PER_SLICE + 2)) == 2
    assert generations(api) == [1, 1]
    # One GPU's tenant: one slice written, generation kept.
    assert writes(api, publisher, devices(PER_SLICE + 2, {0: "team-a"})) == 1
    assert generations(api) == [1, 1]
    # Another GPU's, in the other slice: again one write.
    assert writes(api, publisher, devices(PER_SLICE + 2, {0: "team-a", PER_SLICE: "b"})) == 1
    assert generations(api) == [1, 1]
    assert writes(api, publisher, devices(PER_SLICE + 2, {0: "team-a", PER_SLICE: "b"})) == 0


def test_a_change_over_two_slices_or_a_slice_more_bumps_the_generation() -> None:
    api = server()
    publisher = SlicePublisher(api, NODE)  # type: ignore[arg-type]
    writes(api, publisher, devices(PER_SLICE + 2))
    assert writes(api, publisher, devices(PER_SLICE + 2, {0: "a", PER_SLICE: "b"})) == 2
    assert generations(api) == [2, 2]
    assert writes(api, publisher, devices(2 * PER_SLICE + 1)) == 3  # a third slice
    assert generations(api) == [3, 3, 3]


def test_publish_again_rewrites_every_slice_under_a_new_generation() -> None:
    api = server()
    publisher = SlicePublisher(api, NODE)  # type: ignore[arg-type]
    writes(api, publisher, devices(PER_SLICE + 2))
    publisher.publish_again()
    assert publisher.reconcile_once()
    assert generations(api) == [2, 2]


def test_a_restarted_publisher_never_goes_below_the_servers_generation() -> None:
    api = server()
    first = SlicePublisher(api, NODE)  # type: ignore[arg-type]
    writes(api, first, devices(PER_SLICE + 2))
    for _ in range(3):
        first.publish_again()
        first.reconcile_once()
    assert generations(api) == [4, 4]
    restarted = SlicePublisher(api, NODE)  # type: ignore[arg-type]
    assert writes(api, restarted, devices(PER_SLICE + 2)) == 0  # the same content: no write
    assert writes(api, restarted, devices(PER_SLICE + 2, {0: "a", PER_SLICE: "b"})) == 2
    assert generations(api) == [5, 5]


def test_slices_of_mixed_generations_are_written_under_a_new_one() -> None:
    api = server()
    publisher = SlicePublisher(api, NODE)  # type: ignore[arg-type]
    writes(api, publisher, devices(PER_SLICE + 2))
    path = next(p for p in api.objects if p.startswith(f"{SLICES}/"))
    stale = api.objects[path]
    stale["spec"]["pool"]["generation"] = 0  # as a crash between two writes leaves it
    assert writes(api, publisher, devices(PER_SLICE + 2, {0: "a"})) == 2
    assert generations(api) == [2, 2]
