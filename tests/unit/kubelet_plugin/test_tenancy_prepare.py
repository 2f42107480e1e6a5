"""A shared GPU serves one namespace at a time: prepare refuses a claim of a second namespace
on a GPU whose fractions or MPS daemon serve another, leaves nothing behind for it and keeps
the first tenant's daemon; the GPU is the second namespace's once the first one's claims are
gone; racing claims of four namespaces never end up on one GPU together; an administrator's
``any`` lets namespaces mix."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flexgpu.kubelet_plugin.claims.checkpoint_records import (
    ClaimRecord,
    ClaimState,
    CreatedResources,
    DeviceRecord,
    MpsShareRecord,
)
from flexgpu.kubelet_plugin.claims.tenancy import TenantMixError, check_one_tenant
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from tests.unit.kubelet_plugin.prepare_support import (
    SHARED_GPU,
    ClaimTable,
    Node,
    device,
    share,
)

GPU = f"gpu-{SHARED_GPU}"


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path, ClaimTable())


def _prepare(node: Node, ref: ClaimRef) -> str:
    return node.preparer.prepare([ref])[ref.uid].error


def _prepared_namespaces(node: Node) -> set[str]:
    return {
        r.namespace
        for r in node.store.checkpoint().claims.values()
        if r.state == ClaimState.PREPARED
    }


def test_a_second_namespace_is_refused_on_a_shared_gpu_and_gets_nothing(node: Node) -> None:
    first = node.table.add("a", share(GPU, "s1", "8Gi"), namespace="team-a")
    same = node.table.add("a2", share(GPU, "s2", "8Gi"), namespace="team-a")
    other = node.table.add("b", share(GPU, "s3", "8Gi"), namespace="team-b")
    assert _prepare(node, first) == "" and _prepare(node, same) == ""
    (daemon,) = node.backend.mps_daemons()

    error = _prepare(node, other)
    assert error.startswith("claim team-b/b: gpu-2 serves the claims of another namespace")
    assert "team-a" not in error, "the other tenant is not named to this one"
    assert "serves one namespace at a time" in error
    assert "kubeletPlugin.sharedGpuTenants: any" in error
    # Nothing of the refused claim: no record, no spec; the first tenant's daemon unchanged.
    assert node.store.get(other.uid) is None
    assert not (node.root / "cdi").exists() or not any(
        other.uid in p.name for p in (node.root / "cdi").iterdir()
    )
    assert node.backend.mps_daemons() == [daemon]
    assert node.backend.mps_starts(SHARED_GPU) == 1
    assert _prepared_namespaces(node) == {"team-a"}


def test_the_gpu_is_the_next_namespaces_once_the_first_ones_claims_are_gone(node: Node) -> None:
    first = node.table.add("a", share(GPU, "s1", "8Gi"), namespace="team-a")
    other = node.table.add("b", share(GPU, "s2", "8Gi"), namespace="team-b")
    assert _prepare(node, first) == ""
    assert _prepare(node, other) != ""
    node.preparer.unprepare([first])
    assert node.backend.mps_daemons() == []  # the first tenant's daemon went with it
    assert _prepare(node, other) == ""
    # A fresh daemon for the new tenant, not the first one's.
    assert node.backend.mps_starts(SHARED_GPU) == 2
    assert _prepared_namespaces(node) == {"team-b"}


def test_a_half_prepared_claim_of_another_namespace_also_holds_the_gpu(node: Node) -> None:
    """A record left in PrepareStarted (plugin killed mid-way) may have started the daemon:
    until it is rolled back its namespace holds the GPU."""
    node.store.put(
        ClaimRecord(
            uid="uid-torn",
            namespace="team-a",
            name="torn",
            state=ClaimState.PREPARE_STARTED,
            devices=[DeviceRecord(pool_name="node-a", device_name=GPU, share_id="s9")],
        )
    )
    other = node.table.add("b", share(GPU, "s1", "8Gi"), namespace="team-b")
    assert "gpu-2 serves the claims of another namespace" in _prepare(node, other)


def test_racing_claims_of_four_namespaces_never_share_the_gpu(node: Node) -> None:
    """20 fractions, 5 per namespace, prepared from 20 threads at once (as the kubelet
    does): one namespace's claims get the GPU, every other claim is refused by the rule."""
    refs = [
        node.table.add(f"c{i}", share(GPU, f"s{i}", "2Gi"), namespace=f"team-{i % 4}")
        for i in range(20)
    ]
    start = threading.Barrier(len(refs))

    def run(ref: ClaimRef) -> str:
        start.wait(10)
        return _prepare(node, ref)

    with ThreadPoolExecutor(len(refs)) as pool:
        errors = dict(zip(refs, pool.map(run, refs), strict=True))
    (winner,) = _prepared_namespaces(node)
    for ref, error in errors.items():
        if ref.namespace == winner:
            assert error == "", error
        else:
            assert "serves one namespace at a time" in error, error
    assert len(node.backend.mps_daemons()) == 1


def test_an_administrator_may_let_namespaces_share(node: Node) -> None:
    node.preparer.shared_gpu_tenants = "any"
    first = node.table.add("a", share(GPU, "s1", "8Gi"), namespace="team-a")
    other = node.table.add("b", share(GPU, "s2", "8Gi"), namespace="team-b")
    assert _prepare(node, first) == "" and _prepare(node, other) == ""
    assert _prepared_namespaces(node) == {"team-a", "team-b"}
    assert node.backend.mps_starts(SHARED_GPU) == 1


def test_an_admin_access_claim_neither_holds_nor_is_refused_a_gpu(node: Node) -> None:
    """A monitoring claim (admin access, allowed only in namespaces the administrator
    marks) looks at any tenant's GPU and keeps no tenant off it."""
    tenant = node.table.add("a", share(GPU, "s1", "8Gi"), namespace="team-a")
    monitor = node.table.add(
        "m", device(GPU, share_id="s2", admin_access=True), namespace="monitoring"
    )
    assert _prepare(node, monitor) == ""
    assert _prepare(node, tenant) == ""
    assert _prepared_namespaces(node) == {"team-a", "monitoring"}


def _record(namespace: str, **created: object) -> ClaimRecord:
    return ClaimRecord(
        uid=f"uid-{namespace}",
        namespace=namespace,
        name="c",
        state=ClaimState.PREPARED,
        created=CreatedResources.model_validate(created),
    )


def test_whole_gpu_mps_counts_its_gpu_and_a_mig_daemon_counts_none() -> None:
    """A whole GPU's daemon serves every MPS claim on that GPU; a MIG daemon is its claim's
    own, so a claim on the same parent GPU meets nobody there."""
    whole = _record("team-a", mps_share=MpsShareRecord(gpu_uuids=["GPU-1"], gpu_index=3))
    mig = _record("team-a", mps_share=MpsShareRecord(gpu_uuids=["MIG-1"], gpu_index=4, mig=True))
    with pytest.raises(TenantMixError, match="gpu-3 serves the claims of another") as mixed:
        check_one_tenant("team-b", {3}, [whole], lambda name: None)
    assert mixed.value.holders == (whole.uid,)
    check_one_tenant("team-b", {4}, [mig], lambda name: None)
    check_one_tenant("team-a", {3}, [whole], lambda name: None)  # its own namespace
