"""The demo's workload catalog end to end, on the test cluster: the chart installed, the
controller and three simulated GPU nodes running with the chart's credentials, the real node
with the chart's plugin pod (where this machine allows one), every scenario in demo/ applied,
every row of the demo's table checked, and `flexgpu usage` over the plugins' endpoints
telling the deliberately idle claim from the busy ones."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from demo import catalog, real_node, usage
from demo.world import NODES, DemoWorld, container_seen
from tools.cluster import ControlPlane

pytestmark = pytest.mark.integration

NODE_ROOT = Path("/tmp/fg-demo-test")


@pytest.fixture(scope="module")
def world(cluster: ControlPlane) -> Iterator[DemoWorld]:
    world = DemoWorld(
        cluster.kubeconfig, cluster.workdir / "demo", node_root=NODE_ROOT, cluster=cluster
    )
    try:
        world.start()
        yield world
    finally:
        world.stop()


@pytest.fixture(scope="module")
def rows(world: DemoWorld, api: Any) -> dict[str, catalog.Row]:
    catalog.reset_namespace(api)
    for manifest in catalog.manifests():
        catalog.apply(api, manifest)
    real = world.real
    if real is not None:
        real_node.apply(api, real.images["workload"].name)

    def seen_of(node: str, pod: str) -> catalog.Seen:
        if real is not None and node == real.name:
            return real_node.container_seen(real.layout.pod_logs, pod)
        return container_seen(NODE_ROOT, node, catalog.NAMESPACE, pod)

    settled = catalog.wait_settled(api, seen_of)
    return {r.pod: r for r in settled}


def test_admission_refuses_a_bad_claim_at_creation(
    world: DemoWorld, api: Any, namespace: str
) -> None:
    """The demo's controller listens on a port it picks; the webhook configuration must name
    that port, or claims are admitted unchecked (and fail only when their pod starts)."""
    resource: Any = client.ResourceV1Api(api)
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "mig-time-slice-interval"},
        "spec": {
            "devices": {
                "requests": [{"name": "mig", "exactly": {"deviceClassName": "mig.flexgpu.dev"}}],
                "config": [
                    {
                        "requests": ["mig"],
                        "opaque": {
                            "driver": "gpu.flexgpu.dev",
                            "parameters": {
                                "apiVersion": "gpu.flexgpu.dev/v1alpha1",
                                "kind": "MigConfig",
                                "sharing": {
                                    "strategy": "TimeSlicing",
                                    "timeSlicingConfig": {"interval": "Long"},
                                },
                            },
                        },
                    }
                ],
            }
        },
    }
    with pytest.raises(client.ApiException) as refused:
        resource.create_namespaced_resource_claim(namespace, body)
    assert refused.value.status == 422
    assert (
        "spec.devices.config[0].opaque.parameters.sharing.timeSlicingConfig: unknown field (a "
        "MIG device has no time-slice interval"
    ) in str(refused.value.body)
    assert resource.list_namespaced_resource_claim(namespace).items == []


def test_a_valid_gpu_node_policy_is_accepted(world: DemoWorld, api: Any) -> None:
    """GpuNodePolicies are sent to the webhook with failurePolicy Fail: an unreachable
    webhook would refuse every one of them."""
    objects = client.CustomObjectsApi(api)
    body: dict[str, Any] = {
        "apiVersion": "flexgpu.dev/v1alpha1",
        "kind": "GpuNodePolicy",
        "metadata": {"name": "demo-admission-check"},
        "spec": {
            # Matches no node: the demo's GPUs stay as they are.
            "nodeSelector": {"matchLabels": {"flexgpu.dev/test": "no-such-node"}},
            "gpus": [{"selector": {"all": True}, "mode": "Whole"}],
        },
    }
    objects.create_cluster_custom_object("flexgpu.dev", "v1alpha1", "gpunodepolicies", body)
    objects.delete_cluster_custom_object(
        "flexgpu.dev", "v1alpha1", "gpunodepolicies", "demo-admission-check"
    )


@pytest.mark.requires_k8s(
    "1.35",
    why="measured on 1.34.12: its alpha partitionable-devices allocator leaves MIG pods "
    "unscheduled or on other placements",
)
def test_every_workload_but_the_unsatisfiable_one_runs(
    rows: dict[str, catalog.Row], world: DemoWorld
) -> None:
    assert len(rows) == 19 + (len(real_node.PODS) if world.real else 0)
    assert {name for name, r in rows.items() if r.phase != "Running"} == {"too-big"}
    for name, row in rows.items():
        if name != "too-big":
            assert "visible" in row.limits, row


def test_one_gpu_and_four_nvlink_gpus(rows: dict[str, catalog.Row]) -> None:
    assert rows["one-gpu"].limits == "1 GPU visible"
    # A whole GPU is named by its product, never by a MIG profile.
    assert rows["one-gpu"].detail.startswith("NVIDIA "), rows["one-gpu"]
    assert rows["one-gpu"].uuids.startswith("GPU-") and "," not in rows["one-gpu"].uuids
    assert rows["four-nvlink"].uuids.endswith("(+2)")
    assert rows["four-nvlink"].limits == "4 GPUs visible"
    assert rows["four-nvlink"].devices.endswith("(+2)")


@pytest.mark.requires_k8s(
    "1.35",
    why="measured on 1.34.12: its alpha partitionable-devices allocator leaves MIG pods "
    "unscheduled or on other placements",
)
def test_seven_mig_partitions_on_one_gpu(rows: dict[str, catalog.Row]) -> None:
    migs = [rows[f"mig-{i}"] for i in range(1, 8)]
    assert {r.detail for r in migs} == {"1g.10gb"}
    assert {r.node for r in migs} == {"gpu-node-h100"}
    parents = {r.devices.rsplit("-mig-", 1)[0] for r in migs}
    starts = sorted(int(r.devices.rsplit("-", 1)[1]) for r in migs)
    assert len(parents) == 1 and starts == list(range(7))
    assert all(r.uuids.startswith("MIG-") for r in migs)
    assert len({r.uuids for r in migs}) == 7


def test_fractional_shares_carry_their_limits(rows: dict[str, catalog.Row]) -> None:
    for name in ("share-a", "share-b"):
        assert rows[name].detail == "share compute=0,memory=8Gi"
        assert "mem 0=8192M" in rows[name].limits
    assert rows["share-c"].detail == "share compute=25,memory=4Gi"
    assert "SMs% 25" in rows["share-c"].limits and "mem 0=4096M" in rows["share-c"].limits
    assert {rows[n].node for n in ("share-a", "share-b", "share-c")} == {"gpu-node-l4"}


def test_time_slicing_and_mps(rows: dict[str, catalog.Row]) -> None:
    assert rows["ts-a"].devices == rows["ts-b"].devices and rows["ts-a"].node == rows["ts-b"].node
    assert "time-slice Short" in rows["ts-a"].limits and "time-sliced" in rows["ts-a"].detail
    assert "SMs% 50" in rows["mps"].limits and "mem 0=20480M" in rows["mps"].limits


def test_first_available_cel_memory_and_admin_access(rows: dict[str, catalog.Row]) -> None:
    assert "H100" in rows["best-gpu"].detail or "7g.80gb" in rows["best-gpu"].detail
    assert rows["best-gpu"].node == "gpu-node-h100"  # no H200 here, so the H100 alternative
    assert rows["mid-memory"].detail == "NVIDIA A100-SXM4-40GB"
    assert rows["monitor"].node == "gpu-node-a100" and rows["monitor"].limits == "8 GPUs visible"


def test_unsatisfiable_claim_is_explained(rows: dict[str, catalog.Row], api: Any) -> None:
    message = catalog.explanation(api)
    assert message.startswith("Claim too-big cannot be allocated on any node")
    assert "None of the" in message and "largest are" in message


def test_container_files_come_from_its_spec(rows: dict[str, catalog.Row]) -> None:
    """Simulated nodes have no driver root: their containers get no device nodes or driver
    files, and the table says so rather than leaving the column empty; each gets its
    request's device metadata file (KEP-5304)."""
    assert rows["one-gpu"].files == "no device nodes or driver files; 1 metadata files"
    # MPS clients get the control daemon's pipe and shared memory folders.
    assert " mounts; " in rows["mps"].files, rows["mps"]
    assert rows["mps"].files.endswith(" metadata files"), rows["mps"]
    assert rows["too-big"].files == "-"


def test_usage_lists_only_the_idle_claim_as_idle(
    rows: dict[str, catalog.Row], world: DemoWorld, api: Any
) -> None:
    idle = usage.apply_load(api, {name: NODE_ROOT / name for name, _, _ in NODES})
    assert len(idle) == 1
    report = usage.wait_idle_listed(list(world.metrics.values()), world.kubeconfig, idle)
    claims_part, _, idle_part = report.partition("Idle claims:")
    assert idle[0] in idle_part, report
    listed = [line.split()[1] for line in idle_part.strip().splitlines()[1:]]
    assert listed == idle, report
    assert "Not read" not in report, report
    # The busy ones are reported with usage of their own.
    assert catalog.NAMESPACE in claims_part and "mig" in claims_part.lower(), report


def test_real_node_containers_report_what_they_got_from_inside(
    rows: dict[str, catalog.Row], world: DemoWorld
) -> None:
    """On the real node the runtime applied the plugin's CDI edits: each container has one
    /dev/nvidia<N> per granted GPU, the control nodes and the simulated driver's files."""
    if world.real is None:
        pytest.skip(f"no real node: {world.real_skipped}")
    one, two = rows["real-one-gpu"], rows["real-two-gpus"]
    assert {one.node, two.node} == {real_node.NAME}
    assert one.limits == "1 GPU visible" and two.limits == "2 GPUs visible"
    assert one.detail.startswith("NVIDIA H200"), one
    assert one.uuids.startswith("GPU-") and len(two.uuids.split(", ")) == 2
    assert not set(one.uuids.split(", ")) & set(two.uuids.split(", "))
    assert one.files.startswith("/dev/nvidia") and one.files.count("/dev/nvidia") == 1, one
    assert two.files.count("/dev/nvidia") == 2, two
    for row in (one, two):
        assert "control/caps nodes" in row.files, row
        files = re.search(r"(\d+) driver files", row.files)
        assert files is not None and int(files.group(1)) > 0, row
