"""Claim status writes: one write per claim per window, built on the copy prepare read (no
GET of their own), only this node's entries touched, conflicts re-read and retried."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from flexgpu.driver.names import DRIVER_NAME
from flexgpu.kubelet_plugin.api.kube_api import ApiError
from flexgpu.kubelet_plugin.claims.claim_objects import ClaimObjects
from flexgpu.kubelet_plugin.claims.claim_source import ApiClaimSource, claim_path
from flexgpu.kubelet_plugin.claims.claim_status import ClaimStatusWriter, DeviceStatus
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi

NODE = "node-a"
PATH = claim_path("ns", "c")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


ALLOCATED = [
    {"request": "nic", "driver": "other.example.com", "pool": NODE, "device": "nic-0"},
    {"request": "gpu", "driver": DRIVER_NAME, "pool": NODE, "device": "gpu-0"},
    {"request": "gpu", "driver": DRIVER_NAME, "pool": NODE, "device": "gpu-1"},
]


@pytest.fixture
def api() -> FakeKubeApi:
    fake = FakeKubeApi()
    fake.put_object(
        PATH,
        {
            "metadata": {"name": "c", "namespace": "ns", "uid": "u1"},
            "status": {
                "allocation": {"devices": {"results": ALLOCATED}},
                "devices": [{"driver": "other.example.com", "pool": NODE, "device": "nic-0"}],
            },
        },
    )
    return fake


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def objects() -> ClaimObjects:
    return ClaimObjects()


@pytest.fixture
def writer(api: FakeKubeApi, objects: ClaimObjects, clock: Clock) -> ClaimStatusWriter:
    return ClaimStatusWriter(api, NODE, objects, coalesce_s=1.0, clock=clock)  # type: ignore[arg-type]


def read_by_prepare(api: FakeKubeApi, objects: ClaimObjects) -> None:
    """What the preparer does: one GET through the claim source."""
    ApiClaimSource(api, objects).get("ns", "c")  # type: ignore[arg-type]


GPU0 = DeviceStatus(NODE, "gpu-0", data={"uuid": "GPU-0"})
GPU1 = DeviceStatus(NODE, "gpu-1", data={"uuid": "GPU-1"})


def entries(api: FakeKubeApi) -> list[tuple[str, str]]:
    return [(d["driver"], d["device"]) for d in api.objects[PATH]["status"].get("devices") or []]


def test_prepare_write_uses_the_claim_prepare_read_and_keeps_other_drivers(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    read_by_prepare(api, objects)
    writer.prepared("ns", "c", "u1", [GPU0])
    assert writer.write_due() == 0  # the window is still open
    clock.now += 1.0
    assert writer.write_due() == 1
    assert api.sent == [("GET", PATH), ("PATCH", PATH + "/status")]
    assert entries(api) == [("other.example.com", "nic-0"), (DRIVER_NAME, "gpu-0")]
    (ours,) = [d for d in api.objects[PATH]["status"]["devices"] if d["driver"] == DRIVER_NAME]
    assert ours["data"] == {"uuid": "GPU-0"}
    assert [(c["type"], c["status"]) for c in ours["conditions"]] == [("Ready", "True")]


def test_unprepare_after_a_written_prepare_needs_no_read(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    read_by_prepare(api, objects)
    writer.prepared("ns", "c", "u1", [GPU0])
    clock.now += 1.0
    writer.write_due()
    writer.unprepared("ns", "c", "u1")
    clock.now += 1.0
    writer.write_due()
    # The second write builds on what the first returned.
    assert api.sent == [("GET", PATH), ("PATCH", PATH + "/status"), ("PATCH", PATH + "/status")]
    assert entries(api) == [("other.example.com", "nic-0")]
    assert objects.get("u1") is None  # nothing left to write for it


def test_prepare_undone_within_the_window_writes_nothing(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    read_by_prepare(api, objects)
    writer.prepared("ns", "c", "u1", [GPU0])
    writer.unprepared("ns", "c", "u1")
    clock.now += 1.0
    writer.write_due()
    assert api.sent == [("GET", PATH)]
    assert entries(api) == [("other.example.com", "nic-0")]


def test_changes_within_the_window_become_one_write_of_the_last(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    read_by_prepare(api, objects)
    writer.prepared("ns", "c", "u1", [GPU0])
    writer.unprepared("ns", "c", "u1")
    writer.prepared("ns", "c", "u1", [GPU1])
    clock.now += 0.5
    writer.prepared("ns", "c", "u1", [GPU1])  # does not move the window
    clock.now += 0.5
    writer.write_due()
    assert api.count("PATCH") == 1
    assert entries(api) == [("other.example.com", "nic-0"), (DRIVER_NAME, "gpu-1")]


def test_conflict_reads_again_and_keeps_the_other_writer_s_change(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    read_by_prepare(api, objects)
    # Someone else changes the claim after prepare read it.
    theirs = api.objects[PATH]
    theirs["status"]["devices"].append({"driver": "net.example.com", "pool": "x", "device": "y"})
    theirs["status"]["allocation"]["devices"]["results"].append(
        {"request": "net", "driver": "net.example.com", "pool": "x", "device": "y"}
    )
    api.put_object(PATH, theirs)
    writer.prepared("ns", "c", "u1", [GPU0])
    clock.now += 1.0
    writer.write_due()
    assert api.sent == [
        ("GET", PATH),
        ("PATCH", PATH + "/status"),  # 409: built on the older copy
        ("GET", PATH),
        ("PATCH", PATH + "/status"),
    ]
    assert entries(api) == [
        ("other.example.com", "nic-0"),
        ("net.example.com", "y"),
        (DRIVER_NAME, "gpu-0"),
    ]


def test_without_a_copy_the_claim_is_read_first(
    api: FakeKubeApi, writer: ClaimStatusWriter, clock: Clock
) -> None:
    writer.prepared("ns", "c", "u1", [GPU0])
    clock.now += 1.0
    writer.write_due()
    assert api.sent == [("GET", PATH), ("PATCH", PATH + "/status")]
    assert entries(api)[-1] == (DRIVER_NAME, "gpu-0")


def test_already_written_entries_are_not_written_again(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    writer.prepared("ns", "c", "u1", [GPU0])
    clock.now += 1.0
    writer.write_due()
    clock.now += 5.0  # a later timestamp must not count as a change
    writer.prepared("ns", "c", "u1", [GPU0])
    clock.now += 1.0
    writer.write_due()
    assert api.count("PATCH") == 1


def test_a_recreated_claim_is_not_described(
    api: FakeKubeApi, writer: ClaimStatusWriter, clock: Clock
) -> None:
    writer.prepared("ns", "c", "u-old", [GPU0])
    clock.now += 1.0
    writer.write_due()
    assert api.count("PATCH") == 0
    assert entries(api) == [("other.example.com", "nic-0")]


def test_transient_failure_is_retried_later_and_a_missing_claim_dropped(
    api: FakeKubeApi, writer: ClaimStatusWriter, clock: Clock
) -> None:
    api.fail_next = [ApiError(503, "ServiceUnavailable", "etcd is down")]
    writer.prepared("ns", "c", "u1", [GPU0])
    clock.now += 1.0
    writer.write_due()
    assert writer.pending() == 1 and api.count("PATCH") == 0
    clock.now += 2.0
    writer.write_due()
    assert entries(api)[-1] == (DRIVER_NAME, "gpu-0")
    writer.prepared("ns", "gone", "u2", [GPU1])
    clock.now += 1.0
    writer.write_due()
    assert writer.pending() == 0


def test_a_deleted_claim_is_dropped_without_a_warning(
    api: FakeKubeApi, writer: ClaimStatusWriter, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # Claims are deleted when their pods end, often before the last status write is due.
    writer.prepared("ns", "gone", "u2", [GPU1])
    clock.now += 1.0
    with caplog.at_level(logging.INFO, logger="flexgpu.kubelet_plugin"):
        writer.write_due()
    assert writer.pending() == 0
    dropped = [r for r in caplog.records if "ns/gone status" in r.getMessage()]
    assert dropped and all(r.levelno == logging.INFO for r in dropped)


def test_prepared_never_waits_for_the_api(
    api: FakeKubeApi, objects: ClaimObjects, clock: Clock
) -> None:
    entered, release = threading.Event(), threading.Event()

    class SlowApi(FakeKubeApi):
        def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
            entered.set()
            release.wait(10)
            return api.request(method, path, **kw)

    writer = ClaimStatusWriter(SlowApi(), NODE, objects, coalesce_s=0.0)  # type: ignore[arg-type]
    writer.start()
    try:
        writer.prepared("ns", "c", "u1", [GPU0])
        assert entered.wait(10)  # the writer thread is stuck in the API now
        writer.unprepared("ns", "c", "u1")  # and this still returns at once
        writer.prepared("ns", "c", "u1", [GPU1])
        assert writer.pending() == 1
    finally:
        release.set()
        writer.stop()
    assert entries(api)[-1] == (DRIVER_NAME, "gpu-1")


def test_stop_writes_what_is_pending(api: FakeKubeApi, objects: ClaimObjects) -> None:
    writer = ClaimStatusWriter(api, NODE, objects, coalesce_s=3600.0)  # type: ignore[arg-type]
    writer.start()
    writer.prepared("ns", "c", "u1", [GPU0])
    writer.stop()
    assert entries(api)[-1] == (DRIVER_NAME, "gpu-0")


def test_the_write_never_sends_the_allocation_back(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    """An opaque config's parameters are a RawExtension the API server compares byte by byte:
    re-serialised by the plugin they would look like an allocation change (refused without
    resourceclaims/binding). The write is a merge patch of status.devices alone, guarded by
    the resourceVersion of the claim it was built from."""
    stored = api.objects[PATH]
    stored["status"]["allocation"]["devices"]["config"] = [
        {
            "source": "FromClaim",
            "requests": ["gpu"],
            "opaque": {
                "driver": DRIVER_NAME,
                "parameters": {"apiVersion": "gpu.flexgpu.dev/v1alpha1", "kind": "MigConfig"},
            },
        }
    ]
    version = api.put_object(PATH, stored)["metadata"]["resourceVersion"]
    read_by_prepare(api, objects)
    writer.prepared("ns", "c", "u1", [GPU0])
    clock.now += 1.0
    writer.write_due()
    ((method, path, body),) = api.bodies
    assert (method, path) == ("PATCH", PATH + "/status")
    assert body["metadata"] == {"resourceVersion": version}
    assert list(body["status"]) == ["devices"]
    assert entries(api) == [("other.example.com", "nic-0"), (DRIVER_NAME, "gpu-0")]


def test_entries_of_devices_no_longer_allocated_are_left_out(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    """The claim was allocated anew (gpu-1 only) after the entries were wanted: only gpu-1's
    entry is written, since the server refuses an entry of a device not allocated."""
    read_by_prepare(api, objects)
    stored = api.objects[PATH]
    stored["status"]["allocation"]["devices"]["results"] = [ALLOCATED[0], ALLOCATED[2]]
    api.put_object(PATH, stored)
    writer.prepared("ns", "c", "u1", [GPU0, GPU1])
    clock.now += 1.0
    writer.write_due()
    assert entries(api) == [("other.example.com", "nic-0"), (DRIVER_NAME, "gpu-1")]
    assert writer.refused == 0


def test_a_refused_write_is_built_again_from_a_fresh_read_once(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    refused = ApiError(422, "Invalid", "status.devices[0]: must be an allocated device")
    api.fail_writes = [refused]
    read_by_prepare(api, objects)
    writer.prepared("ns", "c", "u1", [GPU0])
    clock.now += 1.0
    writer.write_due()
    assert api.sent[1:] == [("PATCH", PATH + "/status"), ("GET", PATH), ("PATCH", PATH + "/status")]
    assert entries(api)[-1] == (DRIVER_NAME, "gpu-0")
    # Refused again as built from the fresh read: given up, counted, the reason kept.
    api.fail_writes = [refused, refused]
    writer.prepared("ns", "c", "u1", [GPU1])
    clock.now += 1.0
    writer.write_due()
    assert writer.pending() == 0 and writer.refused == 1
    assert writer.refusal("u1") == refused.message


def test_a_write_that_keeps_meeting_newer_claims_is_retried_later_not_dropped(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    api.fail_writes = [ApiError(409, "Conflict", "the object has been modified")] * 5
    writer.binding("ns", "c", "u1", [GPU0])
    writer.write_due()
    assert api.count("PATCH") == 5
    assert writer.pending() == 1, "dropped after five conflicts"
    clock.now += 10.0
    writer.write_due()
    assert entries(api)[-1] == (DRIVER_NAME, "gpu-0")


def test_where_the_server_takes_the_patch_for_an_allocation_change_the_claim_is_replaced(
    api: FakeKubeApi, objects: ClaimObjects, writer: ClaimStatusWriter, clock: Clock
) -> None:
    """Opaque parameters stored in a non-compact serialisation (the Python client's) make the
    server's own patch look like an allocation change; the claim as just read goes back
    whole instead, and that is not counted as a refusal."""
    changed = ApiError(
        422,
        "Invalid",
        'ResourceClaim.resource.k8s.io "c" is invalid: status.allocation: Invalid value: '
        "null: field cannot be modified once set",
    )
    api.fail_writes = [changed]
    read_by_prepare(api, objects)
    writer.prepared("ns", "c", "u1", [GPU0])
    clock.now += 1.0
    writer.write_due()
    assert [m for m, _, _ in api.bodies] == ["PATCH", "PUT"]
    assert api.sent[-2:] == [("GET", PATH), ("PUT", PATH + "/status")]
    assert entries(api)[-1] == (DRIVER_NAME, "gpu-0")
    assert writer.refused == 0
