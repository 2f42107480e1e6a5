"""What a container would receive for the same claim from flexgpu and from NVIDIA's own DRA
kubelet plugin (v0.4.1, its chart's gates: none): each plugin, on its own simulated node over
the same NVML mock machine and driver root, prepares a claim allocated its GPU 3, and the CDI
edits its answer names — resolved from the CDI specs it wrote, spec-wide and per device, as the
container runtime merges them — are compared: environment, device nodes, mounts, hooks. Every
difference must be listed with its reason in docs/nvidia-differential.md ("CDI edits"); an
unlisted one, or a listed one that no longer exists, fails the test. (The real node's check of
what a container really receives is flexgpu's own, tests/node; NVIDIA's plugin does not run
there yet.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from bench.claims import BenchClaim, allocated_claims
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra.v1 import dra_pb2_grpc
from tests.nvidia_ctk import tools_dir
from tests.nvidia_plugin import nvidia_binary
from tests.nvml_library import MockMachine, library_dir
from tools.cluster import ControlPlane
from tools.node import driver_root
from tools.nvidia_twin import (
    CHART_GATES,
    NVIDIA_DRIVER,
    TwinPlugin,
    flexgpu_twin,
    nvidia_twin,
)

pytestmark = pytest.mark.integration

GPUS = 8
GPU = 3
NAMESPACE = "nvcdi"
DOC = Path(__file__).resolve().parents[2] / "docs" / "nvidia-differential.md"
START, END = "<!-- nvidia-cdi:start -->", "<!-- nvidia-cdi:end -->"
ABSENT = "(absent)"
MACHINE = {
    "machine": "dgxh100",
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "addressingMode": "HMM",
}
Edits = dict[str, str]  # "env NAME" / "device node PATH" / "mount PATH" / "hook NAME" -> value


def _prepare(plugin: TwinPlugin, socket: Path, claim: BenchClaim) -> list[str]:
    """NodePrepareResources as the kubelet calls it; the CDI device ids of the claim."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = dra_pb2_grpc.DRAPluginStub(channel)
        ref = dra_pb2.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)
        reply = stub.NodePrepareResources(
            dra_pb2.NodePrepareResourcesRequest(claims=[ref]), timeout=60, wait_for_ready=True
        )
    entry = reply.claims[claim.uid]
    assert not entry.error, f"{plugin.label}: prepare failed: {entry.error}"
    return [cdi_id for device in entry.devices for cdi_id in device.cdi_device_ids]


def _edits(cdi_dir: Path, cdi_ids: list[str]) -> dict[str, Any]:
    """The container edits the runtime applies for ``cdi_ids``: each spec's own edits once,
    then each named device's."""
    specs = [yaml.safe_load(path.read_text()) for path in sorted(cdi_dir.rglob("*.*"))]
    merged: dict[str, list[Any]] = {"env": [], "deviceNodes": [], "mounts": [], "hooks": []}
    used: set[int] = set()
    for cdi_id in cdi_ids:
        kind, _, name = cdi_id.partition("=")
        for n, spec in enumerate(specs):
            if spec.get("kind") != kind:
                continue
            for device in spec.get("devices") or []:
                if device["name"] != name:
                    continue
                sources = [device.get("containerEdits") or {}]
                if n not in used:
                    sources.insert(0, spec.get("containerEdits") or {})
                    used.add(n)
                for edits in sources:
                    for field, items in merged.items():
                        items.extend(edits.get(field) or [])
    return merged


def _reduce(merged: dict[str, Any], tokens: list[tuple[str, str]]) -> Edits:
    def template(text: str) -> str:
        for literal, placeholder in tokens:
            text = text.replace(literal, placeholder)
        return text

    out: Edits = {}
    for entry in merged["env"]:
        name, _, value = entry.partition("=")
        out[f"env {template(name)}"] = template(value)
    for node in merged["deviceNodes"]:
        host = node.get("hostPath", node["path"])
        out[f"device node {node['path']}"] = template(host)
    for mount in merged["mounts"]:
        out[f"mount {template(mount['containerPath'])}"] = ",".join(mount.get("options") or [])
    for hook in merged["hooks"]:
        args = hook.get("args") or []
        name = args[1] if len(args) > 1 else hook.get("hookName", "")
        out[f"hook {hook.get('hookName', '')} {name}"] = template(" ".join(args[2:]))
    return out


def _present(value: str, other: str) -> str:
    return value if other != ABSENT or value == ABSENT else "present"


@pytest.fixture(scope="module")
def edits(
    cluster: ControlPlane, api: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Edits, Edits]]:
    from kubernetes import client

    binary = nvidia_binary()
    hook = tools_dir() / "nvidia-cdi-hook"
    base = Path(tmp_path_factory.mktemp("nvcdi"))
    root = driver_root.create(base / "driver", GPUS, library_dir() / "libnvidia-ml.so.1").root
    config = base / "nvml-machine.json"
    config.write_text(json.dumps(MACHINE))
    core: Any = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})

    def machine(label: str) -> dict[str, str]:
        return MockMachine(config, base / f"{label}-state.json").env()

    nvidia = nvidia_twin(
        binary,
        "nv-cdi",
        base / "nvidia",
        cluster.kubeconfig,
        driver_root=root,
        cdi_hook=hook,
        machine_env=machine("nvidia"),
        feature_gates=CHART_GATES,
    )
    flexgpu = flexgpu_twin(
        "fg-cdi",
        base / "flexgpu",
        cluster.kubeconfig,
        driver_root=root,
        cdi_hook=hook,
        machine_env=machine("flexgpu"),
        dynamic_mig=False,
    )
    sockets = {
        "nvidia": base / "nvidia" / "plugins" / NVIDIA_DRIVER / "dra.sock",
        "flexgpu": base / "flexgpu" / "plugins" / "gpu.flexgpu.dev" / "dra.sock",
    }
    results: dict[str, Edits] = {}
    try:
        for plugin in (nvidia, flexgpu):
            plugin.start(api)
        for plugin in (nvidia, flexgpu):
            published = plugin.wait_published(api)
            uuid = next(
                d.attributes["uuid"].string
                for s in published
                for d in s.spec.devices or []
                if d.name == f"gpu-{GPU}"
            )
            claim = allocated_claims(
                api,
                NAMESPACE,
                prefix=plugin.label,
                driver=plugin.driver,
                device_class=plugin.driver,
                pool=plugin.node,
                devices=GPU + 1,
                per_device=1,
            )[GPU]
            cdi_ids = _prepare(plugin, sockets[plugin.label], claim)
            folder = base / plugin.label
            tokens = [
                (str(hook), "<hook>"),
                (str(root), "<driver-root>"),
                (str(folder), "<plugin-dir>"),
                (uuid, "<uuid>"),
                (claim.uid, "<claim-uid>"),
                # Environment variable names spell the uid in capitals with underscores.
                (claim.uid.upper().replace("-", "_"), "<CLAIM_UID>"),
            ]
            results[plugin.label] = _reduce(_edits(folder / "cdi", cdi_ids), tokens)
        yield results["nvidia"], results["flexgpu"]
    finally:
        resource: Any = client.ResourceV1Api(api)
        resource.delete_collection_namespaced_resource_claim(NAMESPACE)
        for plugin in (nvidia, flexgpu):
            plugin.remove(api)
        core.delete_namespace(NAMESPACE)


def _measured(theirs: Edits, ours: Edits) -> dict[tuple[str, str, str], None]:
    rows: dict[tuple[str, str, str], None] = {}
    for field in sorted(theirs.keys() | ours.keys()):
        a, b = theirs.get(field, ABSENT), ours.get(field, ABSENT)
        if a != b:
            rows[(field, _present(a, b), _present(b, a))] = None
    return rows


def _documented() -> dict[tuple[str, str, str], str]:
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index(START) + len(START) : text.index(END)]
    rows: dict[tuple[str, str, str], str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("Edit", "") or set(cells[0]) <= {"-", ":"}:
            continue
        field, theirs, ours, why = (c.strip("`") for c in cells)
        rows[(field, theirs, ours)] = why
    return rows


def test_both_give_the_gpus_device_node(edits: tuple[Edits, Edits]) -> None:
    for edit in edits:
        assert edit.get(f"device node /dev/nvidia{GPU}", "").endswith(f"nvidia{GPU}"), edit


def test_cdi_edits_differ_only_where_documented(edits: tuple[Edits, Edits]) -> None:
    measured = _measured(*edits)
    listed = _documented()
    unlisted = [key for key in measured if key not in listed]
    stale = [key for key in listed if key not in measured]
    table = "\n".join(f"| {f} | `{a}` | `{b}` | |" for f, a, b in unlisted)
    assert not unlisted and not stale, (
        f"{DOC.name} (CDI edits) is out of date.\nunlisted:\n{table}\nstale: {stale}"
    )
    assert all(listed[key] for key in measured), "every row needs its reason"
