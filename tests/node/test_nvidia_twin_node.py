"""What a container really receives on the real node for one whole GPU from NVIDIA's own DRA
kubelet plugin (v0.4.1, its chart's gates: none) and from flexgpu's, side by side: NVIDIA's runs
inside the node's namespaces as its DaemonSet would (kubelet registry and plugin folders, the
CDI folder containerd reads, the node's driver root, whose libnvidia-ml.so.1 is the NVML mock
serving a DGX H100), beside flexgpu's chart-installed plugin. One pod per driver asks for one
GPU; each container reports its environment, device nodes (and whether its device cgroup lets
them open), driver files and mounts from inside. The differences are listed with their reasons
in docs/nvidia-differential.md ("On the real node"); an unlisted or stale one fails."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.node.support import (
    create_claim,
    delete_pods,
    gpu_request,
    one_claim_pod,
    run_pod,
    wait_report,
)
from tests.nvidia_ctk import tools_dir
from tests.nvidia_plugin import nvidia_binary
from tools.cluster.process import Component
from tools.node import configs, namespace, report
from tools.node.node import RealNode
from tools.nvidia_twin import NVIDIA_DRIVER

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "nvidia-differential.md"
START, END = "<!-- nvidia-node:start -->", "<!-- nvidia-node:end -->"
ABSENT = "(absent)"
NAMESPACE = "nvtwin-node"
MACHINE = {"machine": "dgxh100", "driverVersion": "580.95.05", "cudaDriverVersion": 13000}


def _in_node_kubeconfig(cluster_kubeconfig: Path, out: Path) -> Path:
    """The admin kubeconfig with the API server where the node's network namespace reaches it
    (the kubernetes Service address, forwarded to the local API server)."""
    config = yaml.safe_load(cluster_kubeconfig.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://{configs.API_SERVICE_IP}:{configs.API_SERVICE_PORT}"
    out.write_text(yaml.safe_dump(config))
    return out


@pytest.fixture(scope="module")
def nvidia_on_node(plugin: RealNode) -> Iterator[Component]:
    node = plugin
    root = node.layout.root / "nvidia-plugin"
    root.mkdir(parents=True, exist_ok=True)
    machine = root / "nvml-machine.json"
    machine.write_text(json.dumps(MACHINE))
    kubelet = node.layout.kubelet_dir
    driver = node.layout.driver_root
    argv = [
        str(nvidia_binary()),
        f"--node-name={node.name}",
        f"--kubeconfig={_in_node_kubeconfig(node.cluster.kubeconfig, root / 'kubeconfig')}",
        f"--cdi-root={node.layout.cdi_dir}",
        f"--nvidia-driver-root={driver}",
        f"--container-driver-root={driver}",
        f"--nvidia-cdi-hook-path={tools_dir() / 'nvidia-cdi-hook'}",
        "--image-name=registry.k8s.io/dra-driver-nvidia-gpu/dra-driver-nvidia-gpu:v0.4.1",
        f"--kubelet-registrar-directory-path={kubelet / 'plugins_registry'}",
        f"--kubelet-plugins-directory-path={kubelet / 'plugins'}",
        "-v=4",
    ]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(Path.home()),
        "FLEXGPU_NVML_MOCK_CONFIG": str(machine),
        "FLEXGPU_NVML_MOCK_STATE": str(root / "nvml-state.json"),
    }
    component = Component(
        "nvidia-plugin", namespace.enter_argv(node.holder_pid, argv), root / "plugin.log", env
    )
    component.start()
    resource: Any = client.ResourceV1Api(node.api)
    resource.create_device_class(
        {
            "metadata": {"name": NVIDIA_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{NVIDIA_DRIVER}'"}}]},
        }
    )
    core: Any = client.CoreV1Api(node.api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    try:
        yield component
    finally:
        component.stop()
        resource.delete_device_class(NVIDIA_DRIVER)
        resource.delete_collection_resource_slice(
            field_selector=f"spec.driver={NVIDIA_DRIVER},spec.nodeName={node.name}"
        )


def _reduce(rep: report.Report, claim: str) -> dict[str, str]:
    """The report with what differs by pod replaced: the GPU's UUID and /dev/nvidiaN, the
    claim's name and uid; the pod's own name (HOSTNAME) is left out."""
    uuids = rep.visible_devices
    gpu_nodes = [p for p in rep.devices if re.fullmatch(r"/dev/nvidia\d+", p)]

    def template(text: str) -> str:
        for uuid in uuids:
            text = text.replace(uuid, "<uuid>")
        for path in gpu_nodes:
            text = re.sub(rf"{re.escape(path)}\b", "/dev/nvidia<N>", text)
        text = re.sub(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "<uid>", text)
        # Variable names spell a uid in capitals with underscores.
        text = re.sub(r"[0-9A-F]{8}(_[0-9A-F]{4}){3}_[0-9A-F]{12}", "<UID>", text)
        # Which GPU the scheduler picked is not the driver's doing.
        text = re.sub(r"_GPU_\d+\b", "_GPU_<N>", re.sub(r"\bgpu-\d+\b", "gpu-<N>", text))
        return text.replace(f"{NAMESPACE}/{claim}", f"{NAMESPACE}/<claim>")

    out: dict[str, str] = {}
    for name, value in rep.env.items():
        if name != "HOSTNAME":
            out[f"env {template(name)}"] = template(value)
    for path, device in rep.devices.items():
        out[f"device {template(path)}"] = "opens" if device.cgroup_allows else "denied"
    for path in rep.files:
        out[f"file {template(path)}"] = "present"
    for mount in rep.mounts:
        out[f"mount {template(mount)}"] = "present"
    return out


@pytest.fixture(scope="module")
def reports(plugin: RealNode, nvidia_on_node: Component) -> Iterator[dict[str, dict[str, str]]]:
    api = plugin.api
    got: dict[str, dict[str, str]] = {}
    labels = ("nvidia", "flexgpu")
    try:
        for label, device_class in zip(labels, (NVIDIA_DRIVER, "gpu.flexgpu.dev"), strict=True):
            request = gpu_request(device_class=device_class)
            create_claim(api, NAMESPACE, label, {"requests": [request]})
            try:
                run_pod(api, NAMESPACE, one_claim_pod(plugin, label, label), timeout_s=120)
            except BaseException:
                print(nvidia_on_node.log_tail(40))
                raise
            got[label] = _reduce(wait_report(plugin, NAMESPACE, label), label)
        yield got
    finally:
        # The session's other tests count on the node's GPUs: give them back (each plugin
        # unprepares while the pod goes) before NVIDIA's plugin stops.
        delete_pods(api, NAMESPACE, *[p.metadata.name for p in _pods(api)])
        client.ResourceV1Api(api).delete_collection_namespaced_resource_claim(NAMESPACE)


def _pods(api: Any) -> list[Any]:
    return list(client.CoreV1Api(api).list_namespaced_pod(NAMESPACE).items)


def _documented() -> dict[tuple[str, str, str], str]:
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index(START) + len(START) : text.index(END)]
    rows: dict[tuple[str, str, str], str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("What the container sees", "") or set(cells[0]) <= {"-"}:
            continue
        seen, theirs, ours, why = (c.strip("`") for c in cells)
        rows[(seen, theirs, ours)] = why
    return rows


def test_each_container_gets_exactly_its_gpu(reports: dict[str, dict[str, str]]) -> None:
    for label, seen in reports.items():
        gpus = [k for k in seen if k.startswith("device /dev/nvidia<N>")]
        assert gpus == ["device /dev/nvidia<N>"], f"{label}: {gpus}"
        assert seen["device /dev/nvidia<N>"] == "opens", f"{label}: its GPU is denied"
        others = [k for k, v in seen.items() if re.fullmatch(r"device /dev/nvidia\d+", k)]
        assert not others, f"{label}: other GPUs' nodes visible: {others}"


def test_containers_differ_only_where_documented(reports: dict[str, dict[str, str]]) -> None:
    theirs, ours = reports["nvidia"], reports["flexgpu"]
    measured = {
        (k, theirs.get(k, ABSENT), ours.get(k, ABSENT))
        for k in theirs.keys() | ours.keys()
        if theirs.get(k, ABSENT) != ours.get(k, ABSENT)
    }
    listed = _documented()
    unlisted = sorted(measured - listed.keys())
    stale = sorted(listed.keys() - measured)
    table = "\n".join(f"| {k} | `{a}` | `{b}` | |" for k, a, b in unlisted)
    assert not unlisted and not stale, f"unlisted:\n{table}\nstale: {stale}"
