"""GPU workloads on a real node (upstream kubelet, containerd with CDI, runc), checked from
inside the containers: what each container's report says it received."""

from __future__ import annotations

import contextlib
import ipaddress
from typing import Any

import pytest
from kubernetes import client

from release.push import manifest_digest
from tests.conftest import wait_for
from tests.node.conftest import DYNAMIC_MIG_GPUS, NODE, PLUGIN_NAMESPACE
from tests.node.support import (
    allocated,
    assert_control_nodes_usable,
    claim_uid,
    claim_uuids,
    create_claim,
    delete_pods,
    gpu_request,
    one_claim_pod,
    run_pod,
    sharing_config,
    wait_report,
    workload_pod,
)
from tools.node import chart, configs, image_source
from tools.node.node import RealNode

pytestmark = pytest.mark.integration


def test_node_joins_with_its_own_credentials_and_runs_a_plain_pod(
    api: Any, namespace: str, real_node: RealNode
) -> None:
    node: Any = client.CoreV1Api(api).read_node(NODE)
    info = node.status.node_info
    assert info.container_runtime_version == "containerd://2.4.2"
    assert info.kubelet_version.startswith("v1.37.")
    # The kubelet refuses a loopback node IP; the node is reached by nothing else.
    assert not node.status.addresses

    pod = workload_pod(real_node, "plain", {"main": []}, {})
    run_pod(api, namespace, pod)
    rep = wait_report(real_node, namespace, "plain")
    assert not rep.devices, "a pod without claims sees no NVIDIA device nodes"
    assert "NVIDIA_VISIBLE_DEVICES" not in rep.env
    assert rep.env["KUBERNETES_SERVICE_HOST"] == configs.API_SERVICE_IP
    ip = client.CoreV1Api(api).read_namespaced_pod("plain", namespace).status.pod_ip
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(configs.POD_SUBNET)
    delete_pods(api, namespace, "plain")


def test_plugin_runs_as_the_charts_daemonset_pod(api: Any, plugin: RealNode) -> None:
    pods = chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)
    assert len(pods) == 1
    owners = {ref.kind for p in pods for ref in p.metadata.owner_references or []}
    assert owners == {"DaemonSet"}
    assert pods[0].spec.containers[0].image == plugin.flexgpu_image


def test_plugin_image_is_pulled_from_the_registry_by_the_digest_pushed(
    api: Any, plugin: RealNode
) -> None:
    """The flexgpu image is not side-loaded: the packaged chart names it by the local
    registry (image.registry/repository) and the digest pushed (image.digest), and the
    node's containerd pulled exactly that manifest (the pod's imageID and containerd's own
    image record both carry the archive's manifest digest)."""
    pushed = manifest_digest(str(plugin.images["flexgpu"].archive))
    registry = plugin.image_source.address
    assert plugin.flexgpu_image == f"{registry}/{image_source.REPOSITORY}@{pushed}"
    (pod,) = chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)
    (status,) = pod.status.container_statuses
    assert status.image_id == plugin.flexgpu_image, status.image_id
    records = plugin.ctr("images", "ls").splitlines()
    pulled = [line.split() for line in records if line.startswith(plugin.flexgpu_image)]
    assert pulled and pulled[0][2] == pushed, records
    # Nothing under the name the archive would be imported as: the image came over the wire.
    assert not any(line.startswith(plugin.images["flexgpu"].name) for line in records)

    def published() -> set[str]:
        slices = client.ResourceV1Api(api).list_resource_slice().items
        return {d.name for s in slices if s.spec.node_name == NODE for d in s.spec.devices or []}

    # The publisher may be replacing a slice generation at this moment: wait for a full one.
    wait_for(
        lambda: {"gpu-0", "gpu-1", "gpu-2", "gpu-3"} <= published(),
        what=f"whole GPUs published for {NODE}",
    )
    assert plugin.plugin_registered("gpu.flexgpu.dev")


def test_preflight_verdict_is_on_the_node(api: Any, plugin: RealNode) -> None:
    """The chart's init container ran `flexgpu doctor node` in the plugin's image on this node:
    its verdict is an Event on the Node, recorded with the plugin's own token."""

    def verdicts() -> list[Any]:
        events = client.CoreV1Api(api).list_namespaced_event("default").items
        return [
            e
            for e in events
            if e.involved_object.name == NODE and e.reason.startswith("FlexgpuPreflight")
        ]

    wait_for(lambda: bool(verdicts()), what=f"a preflight Event on {NODE}")
    event = verdicts()[-1]
    assert event.source.component == "flexgpu-preflight"
    # The simulated driver root has NVML's library; its GPUs come from the chart's topology.
    assert "driver-root" not in event.message or "FAIL" not in event.message, event.message
    pod = chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)[0]
    (init,) = pod.status.init_container_statuses
    assert init.name == "preflight" and init.state.terminated.exit_code == 0


def test_whole_gpu(api: Any, namespace: str, plugin: RealNode) -> None:
    create_claim(api, namespace, "one", {"requests": [gpu_request()]})
    run_pod(api, namespace, one_claim_pod(plugin, "one", "one"))
    rep = wait_report(plugin, namespace, "one")
    assert set(rep.visible_devices) == claim_uuids(api, namespace, "one")
    assert_control_nodes_usable(rep)
    delete_pods(api, namespace, "one")
    # Unprepared once the pod is gone: the claim's CDI spec leaves the node.
    uid = claim_uid(api, namespace, "one")
    wait_for(
        lambda: not list(plugin.layout.cdi_dir.glob(f"*{uid}*")),
        what=f"CDI spec of claim {uid} removed",
    )


def test_whole_gpu_container_gets_only_its_gpu_device_node(
    api: Any, namespace: str, plugin: RealNode
) -> None:
    create_claim(api, namespace, "node", {"requests": [gpu_request()]})
    run_pod(api, namespace, one_claim_pod(plugin, "node", "node"))
    rep = wait_report(plugin, namespace, "node")
    delete_pods(api, namespace, "node")
    assert len(rep.gpu_nodes()) == 1, rep.devices
    assert rep.devices[rep.gpu_nodes()[0]].cgroup_allows


def test_driver_libraries_are_mounted(api: Any, namespace: str, plugin: RealNode) -> None:
    create_claim(api, namespace, "libs", {"requests": [gpu_request()]})
    run_pod(api, namespace, one_claim_pod(plugin, "libs", "libs"))
    rep = wait_report(plugin, namespace, "libs")
    delete_pods(api, namespace, "libs")
    assert any(f.endswith("libnvidia-ml.so.1") for f in rep.files), rep.files


def test_two_pods_get_distinct_gpus(api: Any, namespace: str, plugin: RealNode) -> None:
    for name in ("a", "b"):
        create_claim(api, namespace, name, {"requests": [gpu_request()]})
        run_pod(api, namespace, one_claim_pod(plugin, name, name))
    seen = {name: set(wait_report(plugin, namespace, name).visible_devices) for name in "ab"}
    assert seen["a"] == claim_uuids(api, namespace, "a")
    assert seen["b"] == claim_uuids(api, namespace, "b")
    assert not seen["a"] & seen["b"]
    delete_pods(api, namespace, "a", "b")


def test_four_nvlink_gpus(api: Any, namespace: str, plugin: RealNode) -> None:
    create_claim(
        api,
        namespace,
        "four",
        {
            "requests": [gpu_request(count=4)],
            "constraints": [
                {"requests": ["gpu"], "matchAttribute": "gpu.flexgpu.dev/nvlinkDomain"}
            ],
        },
    )
    run_pod(api, namespace, one_claim_pod(plugin, "four", "four"))
    rep = wait_report(plugin, namespace, "four")
    assert len(rep.visible_devices) == 4
    assert set(rep.visible_devices) == claim_uuids(api, namespace, "four")
    delete_pods(api, namespace, "four")


def test_claim_shared_by_two_pods_and_two_containers(
    api: Any, namespace: str, plugin: RealNode
) -> None:
    create_claim(api, namespace, "shared", {"requests": [gpu_request()]})
    both = {"one": [{"name": "g"}], "two": [{"name": "g"}]}
    run_pod(api, namespace, workload_pod(plugin, "duo", both, {"g": "shared"}))
    run_pod(api, namespace, one_claim_pod(plugin, "solo", "shared"))
    expected = claim_uuids(api, namespace, "shared")
    seen = [
        wait_report(plugin, namespace, "duo", "one"),
        wait_report(plugin, namespace, "duo", "two"),
        wait_report(plugin, namespace, "solo"),
    ]
    for rep in seen:
        assert set(rep.visible_devices) == expected
        assert_control_nodes_usable(rep)
    delete_pods(api, namespace, "duo", "solo")


def test_container_naming_one_request_sees_only_that_requests_devices(
    api: Any, namespace: str, plugin: RealNode
) -> None:
    create_claim(
        api, namespace, "multi", {"requests": [gpu_request("first"), gpu_request("second")]}
    )
    containers = {
        "first": [{"name": "g", "request": "first"}],
        "second": [{"name": "g", "request": "second"}],
    }
    run_pod(api, namespace, workload_pod(plugin, "split", containers, {"g": "multi"}))
    seen = {c: set(wait_report(plugin, namespace, "split", c).visible_devices) for c in containers}
    expected = {request: claim_uuids(api, namespace, "multi", request) for request in containers}
    delete_pods(api, namespace, "split")
    assert seen == expected
    assert not seen["first"] & seen["second"]


def test_device_metadata_per_request_read_only(api: Any, namespace: str, plugin: RealNode) -> None:
    """KEP-5304's files as a container finds them: one per request it names, read-only, each
    naming the request's devices with the UUIDs the container was given."""
    create_claim(
        api, namespace, "meta", {"requests": [gpu_request("first"), gpu_request("second")]}
    )
    containers = {"first": [{"name": "g", "request": "first"}], "both": [{"name": "g"}]}
    run_pod(api, namespace, workload_pod(plugin, "meta", containers, {"g": "meta"}))
    first = wait_report(plugin, namespace, "meta", "first")
    both = wait_report(plugin, namespace, "meta", "both")
    expected = {
        request: claim_uuids(api, namespace, "meta", request) for request in ("first", "second")
    }
    delete_pods(api, namespace, "meta")
    root = "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/meta"
    path = {r: f"{root}/{r}/gpu.flexgpu.dev-metadata.json" for r in expected}
    assert sorted(first.metadata) == [path["first"]]
    assert sorted(both.metadata) == sorted(path.values())
    for request, uuids in expected.items():
        objects = both.metadata_objects(path[request])
        assert [o["apiVersion"] for o in objects] == [
            "metadata.resource.k8s.io/v1beta1",
            "metadata.resource.k8s.io/v1alpha1",
        ]
        (entry,) = objects[0]["requests"]
        assert entry["name"] == request
        assert {d["attributes"]["uuid"]["string"] for d in entry["devices"]} == uuids
    assert set(both.metadata_writes.values()) == {"Read-only file system"}


def test_container_with_two_claims_sees_both(api: Any, namespace: str, plugin: RealNode) -> None:
    for name in ("x", "y"):
        create_claim(api, namespace, name, {"requests": [gpu_request()]})
    pod = workload_pod(
        plugin, "both", {"main": [{"name": "gx"}, {"name": "gy"}]}, {"gx": "x", "gy": "y"}
    )
    run_pod(api, namespace, pod)
    rep = wait_report(plugin, namespace, "both")
    expected = claim_uuids(api, namespace, "x") | claim_uuids(api, namespace, "y")
    delete_pods(api, namespace, "both")
    assert set(rep.visible_devices) == expected


def test_mig_partition_created_on_demand(api: Any, namespace: str, plugin: RealNode) -> None:
    is_small = 'device.attributes["gpu.flexgpu.dev"].profile == "1g.10gb"'
    create_claim(
        api,
        namespace,
        "mig",
        {
            "requests": [
                {
                    "name": "mig",
                    "exactly": {
                        "deviceClassName": "mig.flexgpu.dev",
                        "selectors": [{"cel": {"expression": is_small}}],
                    },
                }
            ]
        },
    )
    run_pod(api, namespace, one_claim_pod(plugin, "mig", "mig"))
    rep = wait_report(plugin, namespace, "mig")
    # The partition exists only once prepared, so its UUID is not published beforehand.
    assert len(rep.visible_devices) == 1
    assert rep.visible_devices[0].startswith("MIG-")
    # Its metadata file names the partition made for it.
    (path,) = rep.metadata
    (device,) = rep.metadata_objects(path)[0]["requests"][0]["devices"]
    assert device["attributes"]["uuid"] == {"string": rep.visible_devices[0]}
    (result,) = allocated(api, namespace, "mig")
    assert result.device.startswith(f"gpu-{DYNAMIC_MIG_GPUS}-mig-1g10gb")
    assert_control_nodes_usable(rep)
    delete_pods(api, namespace, "mig")


def test_mps_claim(api: Any, namespace: str, plugin: RealNode) -> None:
    mps = {
        "strategy": "MPS",
        "mpsConfig": {
            "defaultActiveThreadPercentage": 40,
            "defaultPinnedDeviceMemoryLimit": "10Gi",
        },
    }
    create_claim(
        api,
        namespace,
        "mps",
        {"requests": [gpu_request()], "config": sharing_config(mps)},
    )
    run_pod(api, namespace, one_claim_pod(plugin, "mps", "mps"))
    rep = wait_report(plugin, namespace, "mps")
    assert rep.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert rep.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    # The daemon's pipe folder is mounted where the env points.
    assert rep.env["CUDA_MPS_PIPE_DIRECTORY"] in rep.mounts, rep.mounts
    delete_pods(api, namespace, "mps")


def test_time_slicing(api: Any, namespace: str, plugin: RealNode) -> None:
    sliced = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}
    create_claim(
        api, namespace, "ts", {"requests": [gpu_request()], "config": sharing_config(sliced)}
    )
    for pod in ("ts-a", "ts-b"):
        run_pod(api, namespace, one_claim_pod(plugin, pod, "ts"))
    reports = [wait_report(plugin, namespace, pod) for pod in ("ts-a", "ts-b")]
    assert reports[0].visible_devices == reports[1].visible_devices
    assert all(r.time_slices == {"Short"} for r in reports)
    delete_pods(api, namespace, "ts-a", "ts-b")


def test_gpu_fractions(api: Any, namespace: str, plugin: RealNode) -> None:
    share = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": "shared-gpu.flexgpu.dev",
            "capacity": {"requests": {"memory": "16Gi"}},
        },
    }
    for name in ("f1", "f2"):
        create_claim(api, namespace, name, {"requests": [share]})
        run_pod(api, namespace, one_claim_pod(plugin, name, name))
    reports = [wait_report(plugin, namespace, name) for name in ("f1", "f2")]
    # Two 16Gi shares of one 80GB GPU: the same GPU, each limited to its share.
    assert reports[0].visible_devices == reports[1].visible_devices
    for rep in reports:
        assert rep.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16384M"
    delete_pods(api, namespace, "f1", "f2")


def test_concurrent_prepares_for_different_pods(api: Any, namespace: str, plugin: RealNode) -> None:
    core = client.CoreV1Api(api)
    names = [f"c{i}" for i in range(4)]
    for name in names:
        create_claim(api, namespace, name, {"requests": [gpu_request()]})
    # Created back to back, the kubelet prepares them in parallel.
    for name in names:
        core.create_namespaced_pod(namespace, one_claim_pod(plugin, name, name))
    try:
        for name in names:
            rep = wait_report(plugin, namespace, name, timeout_s=90)
            assert set(rep.visible_devices) == claim_uuids(api, namespace, name)
    finally:
        delete_pods(api, namespace, *names)


def _report_after(script: str) -> list[str]:
    """A workload command that runs ``script`` (its exports land in the report), then reports."""
    return ["/bin/sh", "-c", f"{script}; exec /usr/local/bin/gpu-report"]


def test_a_tenant_reaches_no_other_namespaces_mps_pipe_or_shm(
    api: Any, namespace: str, plugin: RealNode
) -> None:
    """From inside the containers: a fraction's container gets its daemon's pipe folder and
    shared memory, not its log folder; a container of another namespace (an MPS claim of its
    own on another GPU) sees neither that pipe folder nor what the first tenant left in its
    /dev/shm; and the other namespace's fraction is refused on the GPU the first one holds."""
    core = client.CoreV1Api(api)
    other = f"{namespace}-b"
    core.create_namespace({"metadata": {"name": other}})
    share = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": "shared-gpu.flexgpu.dev",
            "capacity": {"requests": {"memory": "16Gi"}},
        },
    }
    try:
        create_claim(api, namespace, "frac-a", {"requests": [share]})
        pod_a = one_claim_pod(plugin, "tenant-a", "frac-a")
        pod_a["spec"]["containers"][0]["command"] = _report_after(
            "echo private > /dev/shm/tenant-a-secret"
        )
        run_pod(api, namespace, pod_a)
        rep_a = wait_report(plugin, namespace, "tenant-a")
        pipe_a = rep_a.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert pipe_a in rep_a.mounts, rep_a.mounts
        assert "CUDA_MPS_LOG_DIRECTORY" not in rep_a.env
        assert not [m for m in rep_a.mounts if m.endswith("/log")], rep_a.mounts

        mps = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}
        create_claim(
            api, other, "mps-b", {"requests": [gpu_request()], "config": sharing_config(mps)}
        )
        pod_b = one_claim_pod(plugin, "tenant-b", "mps-b")
        pod_b["spec"]["containers"][0]["command"] = _report_after(
            'export SEEN_SHM="$(ls -A /dev/shm | tr "\\n" " ")"; '
            f'export SEEN_PIPE="$(ls -A {pipe_a} 2>&1 | tr "\\n" " ")"'
        )
        run_pod(api, other, pod_b)
        rep_b = wait_report(plugin, other, "tenant-b")
        assert rep_b.env["CUDA_MPS_PIPE_DIRECTORY"] != pipe_a
        assert pipe_a not in rep_b.mounts, rep_b.mounts
        assert "tenant-a-secret" not in rep_b.env.get("SEEN_SHM", ""), rep_b.env
        assert "No such file" in rep_b.env["SEEN_PIPE"], rep_b.env

        # The other namespace's fraction: the only shared GPU serves the first namespace.
        create_claim(api, other, "frac-b", {"requests": [share]})
        core.create_namespaced_pod(other, one_claim_pod(plugin, "tenant-b-share", "frac-b"))

        def refused() -> str:
            for e in core.list_namespaced_event(other).items:
                if e.involved_object.name == "tenant-b-share" and "namespace at a time" in (
                    e.message or ""
                ):
                    return str(e.message)
            return ""

        message = wait_for(refused, timeout_s=90, what="the mixed fraction refused")
        assert "serves the claims of another namespace" in message
        # The other tenant (whose namespace name is a prefix of this one's) is not named.
        assert f"'{namespace}'" not in message and f"{namespace}/" not in message
        assert "frac-a" not in message
        assert core.read_namespaced_pod("tenant-b-share", other).status.phase == "Pending"
    finally:
        with contextlib.suppress(client.ApiException):
            delete_pods(api, other, "tenant-b", "tenant-b-share")
        with contextlib.suppress(client.ApiException, AssertionError):
            delete_pods(api, namespace, "tenant-a")
        core.delete_namespace(other)
