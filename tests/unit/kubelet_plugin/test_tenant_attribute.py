"""A shared GPU is published with the namespace it serves (``tenant``, "" while free), read
from the node's claim records: it changes when a namespace's first claim is prepared and its
last one unprepared, and at no other time (no republish for an unchanged value, none for a
refused claim); a restarted plugin publishes what its records say; half-prepared records hold
the GPU as prepare's guard does; with ``any`` nothing is published; only shared GPUs carry
it; a failing update never fails a prepare."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord, ClaimState, DeviceRecord
from flexgpu.kubelet_plugin.claims.pipeline import ClaimPipeline
from flexgpu.kubelet_plugin.claims.tenant_attribute import TenantAttribute, TenantTracking
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from tests.unit.kubelet_plugin.prepare_support import SHARED_GPU, ClaimTable, Node, share

GPU = f"gpu-{SHARED_GPU}"


class Published:
    """What the slice publisher was handed, one entry per republish."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.calls: list[list[dict[str, Any]]] = []

    def __call__(self) -> None:
        self.calls.append(self.node.devices.slice_devices())

    def tenant(self, name: str = GPU, call: int = -1) -> str | None:
        (device,) = [d for d in self.calls[call] if d["name"] == name]
        value = device["attributes"].get("tenant")
        return None if value is None else str(value["string"])


@pytest.fixture
def node(tmp_path: Path) -> Node:
    made = Node(tmp_path, ClaimTable())
    made.devices.publish_tenants = True
    return made


def _now(node: Node) -> str:
    """The shared GPU's tenant in what the devices would publish now."""
    (device,) = [d for d in node.devices.slice_devices() if d["name"] == GPU]
    return str(device["attributes"]["tenant"]["string"])


def _tracking(node: Node) -> tuple[ClaimPipeline, Published]:
    """The preparer behind the tenancy stage, as the plugin serves it."""
    published = Published(node)
    attribute = TenantAttribute(node.preparer.load_checkpoint, node.devices, published)
    return ClaimPipeline([TenantTracking(attribute.update)], node.preparer), published


def _ok(driver: ClaimPipeline, ref: ClaimRef) -> None:
    assert driver.prepare([ref])[ref.uid].error == ""


def test_the_tenant_follows_the_first_prepare_and_the_last_unprepare_of_a_namespace(
    node: Node,
) -> None:
    driver, published = _tracking(node)
    assert _now(node) == ""
    first = node.table.add("a1", share(GPU, "s1", "8Gi"), namespace="team-a")
    second = node.table.add("a2", share(GPU, "s2", "8Gi"), namespace="team-a")
    _ok(driver, first)
    assert len(published.calls) == 1 and published.tenant() == "team-a"
    _ok(driver, second)
    driver.unprepare([first])
    assert len(published.calls) == 1, "the value did not change: nothing republished"
    driver.unprepare([second])
    assert len(published.calls) == 2 and published.tenant() == ""


def test_a_refused_claim_of_another_namespace_changes_nothing_published(node: Node) -> None:
    driver, published = _tracking(node)
    _ok(driver, node.table.add("a", share(GPU, "s1", "8Gi"), namespace="team-a"))
    other = node.table.add("b", share(GPU, "s2", "8Gi"), namespace="team-b")
    assert "serves one namespace at a time" in driver.prepare([other])[other.uid].error
    assert len(published.calls) == 1 and published.tenant() == "team-a"


def test_after_a_restart_the_tenant_is_rebuilt_from_the_records(node: Node) -> None:
    driver, _ = _tracking(node)
    _ok(driver, node.table.add("a", share(GPU, "s1", "8Gi"), namespace="team-a"))
    node.restart()  # a new plugin process: devices start with no tenants
    node.devices.publish_tenants = True
    assert _now(node) == ""
    _, published = _tracking(node)
    attribute = TenantAttribute(node.preparer.load_checkpoint, node.devices, published)
    assert attribute.update()
    assert published.tenant() == "team-a"
    assert not attribute.update(), "a second pass with the same records writes nothing"


def test_a_half_prepared_record_holds_the_gpu_for_its_namespace(node: Node) -> None:
    """A record left in PrepareStarted (a crash mid-prepare) holds the GPU for prepare's
    guard, so the published value names its namespace too."""
    share_device = DeviceRecord(
        request="gpu",
        pool_name="node",
        device_name=GPU,
        share_id="s1",
        consumed_capacity={"memory": "8Gi"},
    )
    node.store.put(
        ClaimRecord(
            uid="uid-x",
            namespace="team-x",
            name="x",
            state=ClaimState.PREPARE_STARTED,
            devices=[share_device],
        )
    )
    _, published = _tracking(node)
    attribute = TenantAttribute(node.preparer.load_checkpoint, node.devices, published)
    assert attribute.update() and published.tenant() == "team-x"


def test_with_namespaces_allowed_to_share_no_tenant_is_published(node: Node) -> None:
    node.devices.publish_tenants = False
    driver, published = _tracking(node)
    _ok(driver, node.table.add("a", share(GPU, "s1", "8Gi"), namespace="team-a"))
    assert published.calls == []
    assert all("tenant" not in d["attributes"] for d in node.devices.slice_devices())


def test_only_shared_gpus_carry_the_attribute(node: Node) -> None:
    carrying = {d["name"] for d in node.devices.slice_devices() if "tenant" in d["attributes"]}
    assert carrying == {GPU}


def test_racing_claims_of_four_namespaces_end_with_the_prepared_namespace_published(
    node: Node,
) -> None:
    driver, published = _tracking(node)
    refs = [
        node.table.add(f"c{ns}{i}", share(GPU, f"s{ns}{i}", "2Gi"), namespace=f"team-{ns}")
        for ns in range(4)
        for i in range(5)
    ]
    with ThreadPoolExecutor(max_workers=20) as pool:
        errors = list(pool.map(lambda ref: driver.prepare([ref])[ref.uid].error, refs))
    winners = {ref.namespace for ref, error in zip(refs, errors, strict=True) if not error}
    assert len(winners) == 1
    assert published.tenant() == winners.pop()
    assert len(published.calls) == 1, "one namespace took the GPU: one change published"


def test_a_failing_update_never_fails_the_prepare(node: Node) -> None:
    def broken() -> None:
        raise RuntimeError("publisher gone")

    attribute = TenantAttribute(node.preparer.load_checkpoint, node.devices, broken)
    driver = ClaimPipeline([TenantTracking(attribute.update)], node.preparer)
    _ok(driver, node.table.add("a", share(GPU, "s1", "8Gi"), namespace="team-a"))
    assert driver.prepare([]) == {}
