"""A stolen kubelet plugin token is not root on its node: with the chart's own plugin
ServiceAccount token, bound to a node as a plugin pod's is, the apiserver admits the MPS
daemon pods the plugin renders (a whole GPU's and a MIG device daemon's) and refuses every
pod that differs from them in a way that could run other code or reach more of the host:
hooks, probes, other mounts of the driver root or the MPS root, propagation, environment,
capabilities and profiles, ports, containers, runtime class, claims, owner, names and
folders of another GPU. The chart's RBAC and admission policy for MPS pods are rendered by
helm for the server's version and applied as they are."""

from __future__ import annotations

import contextlib
import copy
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client, config

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
from flexgpu.kubelet_plugin.agents.mps_pods import MpsDaemonPods
from flexgpu.kubelet_plugin.api.kube_api import KubeApi
from tests.conftest import wait_for
from tests.integration.gpu_workloads import default_chart_image
from tools.cluster import ControlPlane, create_simulated_node
from tools.cluster.binaries import REPO_ROOT, helm_tools_dir
from tools.cluster.tokens import service_account_kubeconfig

pytestmark = pytest.mark.integration

RELEASE = "mpsadm"
NS = "flexgpu-mps-admission"
PLUGIN_SA = f"{RELEASE}-flexgpu-kubelet-plugin"
DAEMONSET = f"{RELEASE}-flexgpu-kubelet-plugin"
NODE, OTHER_NODE = "mps-adm-node-a", "mps-adm-node-b"
UUID = "GPU-0b5c1e4e-1d3a-4c55-9d5e-2c1f7a9e0001"
OTHER_UUID = "GPU-0b5c1e4e-1d3a-4c55-9d5e-2c1f7a9e0002"
MIG_UUIDS = ("MIG-1f0e2d3c-4b5a-6978-8a9b-0c1d2e3f4a01", "MIG-1f0e2d3c-4b5a-6978-8a9b-0c1d2e3f4a02")
# A RuntimeClass that exists (the apiserver refuses a pod naming one that does not).
RUNTIME_CLASS = "flexgpu-mps-admission-other"
TEMPLATES = ("kubelet-plugin-rbac.yaml", "mps-pods-admission-policy.yaml")


@pytest.fixture(scope="module")
def mps_root(cluster: ControlPlane) -> Path:
    return cluster.workdir / "mps-admission"


@pytest.fixture(scope="module")
def chart_image() -> str:
    return default_chart_image()


@pytest.fixture(scope="module")
def plugin_api(cluster: ControlPlane, api: Any, mps_root: Path) -> Iterator[Any]:
    """The chart's plugin RBAC and MPS pod policy (chart defaults, but the MPS root), and a
    client authenticated with the plugin's ServiceAccount token bound to NODE."""
    tools = helm_tools_dir()
    version = client.VersionApi(api).get_code().git_version.lstrip("v")
    argv = [str(tools / "helm"), "template", RELEASE, str(REPO_ROOT / "charts/flexgpu")]
    argv += ["--namespace", NS, "--kube-version", version]
    argv += ["--set", f"kubeletPlugin.mpsRoot={mps_root}"]
    for template in TEMPLATES:
        argv += ["--show-only", f"templates/{template}"]
    rendered = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert rendered.returncode == 0, rendered.stderr
    manifest = cluster.workdir / "mps-admission.yaml"
    manifest.write_text(rendered.stdout)
    kubectl = [str(tools / "kubectl"), "--kubeconfig", str(cluster.kubeconfig)]
    subprocess.run([*kubectl, "create", "namespace", NS], capture_output=True, check=False)
    applied = subprocess.run(
        [*kubectl, "apply", "-f", str(manifest)], capture_output=True, text=True, check=False
    )
    assert applied.returncode == 0, applied.stderr
    for name in (NODE, OTHER_NODE):
        create_simulated_node(api, name)
    with contextlib.suppress(client.ApiException):  # from an earlier run of this module
        client.NodeV1Api(api).create_runtime_class(
            {"metadata": {"name": RUNTIME_CLASS}, "handler": "runc"}
        )
    kubeconfig = service_account_kubeconfig(
        api,
        cluster.kubeconfig,
        NS,
        PLUGIN_SA,
        cluster.workdir / "mps-admission-plugin.kubeconfig",
        node=NODE,
    )
    as_plugin = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    _policy_loaded(as_plugin)
    yield as_plugin
    subprocess.run([*kubectl, "delete", "-f", str(manifest)], capture_output=True, check=False)
    subprocess.run(
        [*kubectl, "delete", "namespace", NS, "--wait=false"], capture_output=True, check=False
    )


def _daemons(mps_root: Path, image: str) -> MpsDaemonPods:
    """The plugin's pod builder with the chart's settings: the host's / as driver root,
    mounted at /driver-root; the chart's image; owned by the chart's DaemonSet."""
    return MpsDaemonPods(
        cast(KubeApi, None),  # building a pod with a given owner calls no API
        cast(GpuBackend, None),  # nor any GPU
        node_name=NODE,
        namespace=NS,
        image=image,
        mps_root=mps_root,
        driver_root=Path("/driver-root"),
        host_driver_root=Path("/"),
        owner={
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "name": DAEMONSET,
            "uid": "5d1f3c2a-0b4e-4f6a-9c8d-7e6f5a4b3c2d",
        },
    )


@pytest.fixture(scope="module")
def whole_gpu_pod(mps_root: Path, chart_image: str) -> dict[str, Any]:
    daemons = _daemons(mps_root, chart_image)
    return daemons._pod(daemons._daemon(0, UUID))


def _policy_loaded(as_plugin: Any) -> None:
    """Admission policies take effect a moment after they are created: wait until a dry
    run of a pod on another node is refused."""
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "flexgpu-mps-probe"},
        "spec": {"nodeName": OTHER_NODE, "containers": [{"name": "c", "image": "x"}]},
    }

    def refused() -> bool:
        try:
            as_plugin.create_namespaced_pod(NS, probe, dry_run="All")
        except client.ApiException as error:
            return error.status in (403, 422)
        return False

    wait_for(refused, what="the MPS pod admission policy")


def _refusal(as_plugin: Any, pod: dict[str, Any]) -> str:
    try:
        as_plugin.create_namespaced_pod(NS, pod, dry_run="All")
    except client.ApiException as error:
        assert error.status in (403, 422), error
        return str(error.body)
    pytest.fail("the changed pod was admitted")


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    return cast(dict[str, Any], pod["spec"]["containers"][0])


def _mount(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in _container(pod)["volumeMounts"] if m["name"] == name)


def _env(pod: dict[str, Any], name: str, value: str) -> None:
    for entry in _container(pod)["env"]:
        if entry["name"] == name:
            entry["value"] = value


def _security(pod: dict[str, Any], **fields: Any) -> None:
    _container(pod)["securityContext"].update(fields)


EXEC = {"exec": {"command": ["/bin/sh", "-c", "chroot /driver-root sh"]}}

# (what is changed, the change, a part of the refusal that names the rule)
MUTATIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "postStart hook",
        lambda p: _container(p).update(lifecycle={"postStart": EXEC}),
        "lifecycle",
    ),
    (
        "preStop hook",
        lambda p: _container(p).update(lifecycle={"preStop": EXEC}),
        "lifecycle",
    ),
    (
        "exec liveness probe",
        lambda p: _container(p).update(livenessProbe=EXEC),
        "livenessProbe",
    ),
    (
        "exec startup probe",
        lambda p: _container(p).update(startupProbe=EXEC),
        "startupProbe",
    ),
    (
        "driver root mounted again at /host",
        lambda p: _container(p)["volumeMounts"].append({"name": "driver", "mountPath": "/host"}),
        "mounts exactly mps",
    ),
    (
        "driver root mounted with a subPath",
        lambda p: _mount(p, "driver").update(subPath="etc"),
        "subPath",
    ),
    (
        "writable MPS root mounted over the driver's programs",
        lambda p: _mount(p, "mps").update(mountPath="/driver-root/usr/bin"),
        "mounts exactly mps",
    ),
    (
        "driver root read-write",
        lambda p: _mount(p, "driver").update(readOnly=False),
        "driver read-only at /driver-root",
    ),
    (
        "Bidirectional propagation",
        lambda p: _mount(p, "mps").update(mountPropagation="Bidirectional"),
        "no mount propagation",
    ),
    (
        "LD_LIBRARY_PATH to another folder",
        lambda p: _env(p, "LD_LIBRARY_PATH", "/driver-root/tmp"),
        "LD_LIBRARY_PATH=",
    ),
    (
        "LD_PRELOAD added",
        lambda p: _container(p)["env"].append({"name": "LD_PRELOAD", "value": "/x.so"}),
        "environment is exactly",
    ),
    (
        "pipe folder of another GPU",
        lambda p: _env(p, "CUDA_MPS_PIPE_DIRECTORY", f"/run/{OTHER_UUID}/pipe"),
        "CUDA_MPS_PIPE_DIRECTORY=",
    ),
    (
        "capabilities ALL",
        lambda p: _security(p, capabilities={"add": ["ALL"]}),
        "capabilities",
    ),
    (
        "seccomp Unconfined",
        lambda p: _security(p, seccompProfile={"type": "Unconfined"}),
        "seccompProfile",
    ),
    (
        "AppArmor Unconfined",
        lambda p: _security(p, appArmorProfile={"type": "Unconfined"}),
        "appArmorProfile",
    ),
    (
        "shm at the MPS root itself",
        lambda p: p["spec"]["volumes"][1]["hostPath"].update(
            path=p["spec"]["volumes"][0]["hostPath"]["path"]
        ),
        "spec.volumes",
    ),
    (
        "shm of another GPU's daemon",
        lambda p: p["spec"]["volumes"][1]["hostPath"].update(
            path=p["spec"]["volumes"][1]["hostPath"]["path"].replace(UUID, OTHER_UUID)
        ),
        "spec.volumes",
    ),
    (
        "another host path",
        lambda p: p["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
        "spec.volumes",
    ),
    (
        "hostPort",
        lambda p: _container(p).update(ports=[{"containerPort": 22, "hostPort": 2222}]),
        "ports",
    ),
    (
        "host network",
        lambda p: p["spec"].update(hostNetwork=True),
        "hostNetwork",
    ),
    (
        "no ownerReferences",
        lambda p: p["metadata"].pop("ownerReferences"),
        "metadata.ownerReferences",
    ),
    (
        "owned by the Node (helm uninstall would leave it)",
        lambda p: p["metadata"].update(
            ownerReferences=[{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "u"}]
        ),
        "metadata.ownerReferences",
    ),
    (
        "init container",
        lambda p: p["spec"].update(initContainers=[dict(_container(p), name="init")]),
        "initContainers",
    ),
    (
        "a second container",
        lambda p: p["spec"]["containers"].append(dict(_container(p), name="second")),
        "exactly one container",
    ),
    (
        "runtime class",
        lambda p: p["spec"].update(runtimeClassName=RUNTIME_CLASS),
        "runtimeClassName",
    ),
    (
        "ServiceAccount token mounted",
        lambda p: p["spec"].pop("automountServiceAccountToken"),
        "automountServiceAccountToken",
    ),
    (
        "unsafe sysctl",
        lambda p: p["spec"].update(
            securityContext={"sysctls": [{"name": "kernel.msgmax", "value": "65536"}]}
        ),
        "spec.securityContext",
    ),
    (
        "a resource claim",
        lambda p: p["spec"].update(
            resourceClaims=[{"name": "g", "resourceClaimName": "someone-elses"}]
        ),
        "resourceClaims",
    ),
    (
        "arguments",
        lambda p: _container(p).update(args=["--help"]),
        "runs /driver-root/usr/bin/nvidia-cuda-mps-control -f, not",
    ),
    (
        "a shell instead of the daemon",
        lambda p: _container(p).update(command=["/bin/sh", "-c", "chroot /driver-root"]),
        "runs /driver-root/usr/bin/nvidia-cuda-mps-control -f, not /bin/sh",
    ),
    (
        "another image",
        lambda p: _container(p).update(image="docker.io/library/busybox:1.36"),
        "busybox",
    ),
    (
        "another node",
        lambda p: p["spec"].update(nodeName=OTHER_NODE),
        f"not on node '{OTHER_NODE}'",
    ),
    (
        "a name that is not its GPU's",
        lambda p: p["metadata"].update(name=f"flexgpu-mps-{OTHER_UUID.lower()}"),
        "metadata.name",
    ),
    (
        "a working directory",
        lambda p: _container(p).update(workingDir="/driver-root"),
        "workingDir",
    ),
    (
        "more memory",
        lambda p: _container(p)["resources"]["limits"].update(memory="64Gi"),
        "resources",
    ),
]


@pytest.mark.parametrize(("change", "mutate", "named"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_changed_mps_daemon_pod_is_refused(
    plugin_api: Any,
    whole_gpu_pod: dict[str, Any],
    change: str,
    mutate: Callable[[dict[str, Any]], None],
    named: str,
) -> None:
    pod = copy.deepcopy(whole_gpu_pod)
    mutate(pod)
    message = _refusal(plugin_api, pod)
    assert named in message, f"{change}: {message}"


def test_the_plugins_own_daemon_pods_are_admitted_and_deleted(
    plugin_api: Any, api: Any, whole_gpu_pod: dict[str, Any], mps_root: Path, chart_image: str
) -> None:
    daemons = _daemons(mps_root, chart_image)
    spec = MigMpsDaemonSpec(parent_index=1, device_uuids=MIG_UUIDS, active_thread_percentage=30)
    mig_pod = daemons._pod(daemons._daemon(1, spec.key), spec)
    for pod in (whole_gpu_pod, mig_pod):
        created = plugin_api.create_namespaced_pod(NS, copy.deepcopy(pod))
        assert created.spec.node_name == NODE
        assert not created.spec.automount_service_account_token
        assert [v.name for v in created.spec.volumes] == ["mps", "shm", "driver"]
        # The plugin never updates a pod, and deletes only its own node's.
        patched = {"metadata": {"labels": {"x": "y"}}}
        try:
            plugin_api.patch_namespaced_pod(created.metadata.name, NS, patched)
        except client.ApiException as error:
            assert error.status == 403, error
        else:
            pytest.fail("the plugin updated a pod")
        plugin_api.delete_namespaced_pod(created.metadata.name, NS)


def test_the_plugin_deletes_no_other_nodes_daemon_pod(plugin_api: Any, api: Any) -> None:
    admin = client.CoreV1Api(api)
    other = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"flexgpu-mps-{OTHER_UUID.lower()}",
            "labels": {"app.kubernetes.io/component": "mps-control-daemon"},
        },
        "spec": {"nodeName": OTHER_NODE, "containers": [{"name": "c", "image": "x"}]},
    }
    admin.create_namespaced_pod(NS, other)
    try:
        with pytest.raises(client.ApiException) as refused:
            plugin_api.delete_namespaced_pod(other["metadata"]["name"], NS)
        assert refused.value.status in (403, 422)
        assert f"not on node '{OTHER_NODE}'" in str(refused.value.body)
    finally:
        admin.delete_namespaced_pod(other["metadata"]["name"], NS, grace_period_seconds=0)
