"""NVIDIA's kubelet plugin on the session's real node beside flexgpu's, and what a container
reported from inside reduced to what does not depend on the pod: shared by the node tests that
compare the two drivers (test_nvidia_twin_node.py, test_nvidia_quickstart_node.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.nvidia_ctk import tools_dir
from tests.nvidia_plugin import nvidia_binary
from tests.nvml_library import ENV_CONFIG, ENV_STATE, MockMachine
from tools.cluster.process import Component
from tools.node import report
from tools.node.node import RealNode
from tools.nvidia_twin import STATIC_GATES, node_plugin

DOC = Path(__file__).resolve().parents[2] / "docs" / "nvidia-differential.md"
ABSENT = "(absent)"
# The MIG capability files every container may get (config, monitor): not a partition's own.
SHARED_CAPS = {"/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"}


@contextmanager
def nvidia_plugin(node: RealNode, made: MockMachine) -> Iterator[Component]:
    """NVIDIA's plugin (the gates of STATIC_GATES) running on ``node`` over the NVML mock
    machine ``made``, its DeviceClasses created; stopped and its classes and slices removed
    afterwards."""
    component = node_plugin.start(
        node,
        node.layout.root / "nvidia-plugin",
        binary=nvidia_binary(),
        cdi_hook=tools_dir() / "nvidia-cdi-hook",
        machine_env={k: v for k, v in made.env().items() if k in (ENV_CONFIG, ENV_STATE)},
        feature_gates=STATIC_GATES,
    )
    try:
        node_plugin.create_device_classes(node.api)
        yield component
    finally:
        component.stop()
        node_plugin.remove(node.api, node)


def reduce(rep: report.Report) -> dict[str, str]:
    """The report with what differs by pod replaced: the GPU's (or MIG device's) UUID and
    /dev/nvidiaN, a partition's own capability nodes, device names, the claim's name and uid;
    the pod's own name (HOSTNAME) is left out. Keys say what was seen (``env NAME``,
    ``device PATH``, ``file PATH``, ``mount PATH``)."""
    uuids = rep.visible_devices
    gpu_nodes = [p for p in rep.devices if re.fullmatch(r"/dev/nvidia\d+", p)]
    caps = sorted(
        (p for p in rep.devices if p.startswith("/dev/nvidia-caps/") and p not in SHARED_CAPS),
        key=lambda p: int(re.sub(r"\D", "", p) or 0),
    )
    cap_names = dict(zip(caps, ("<gi-cap>", "<ci-cap>", "<cap3>", "<cap4>"), strict=False))

    def template(text: str) -> str:
        for uuid in uuids:
            text = text.replace(uuid, "<uuid>")
        # Other UUIDs (a MIG device's parent) by kind.
        text = re.sub(r"\bGPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "<gpu-uuid>", text)
        for path in gpu_nodes:
            text = re.sub(rf"{re.escape(path)}\b", "/dev/nvidia<N>", text)
        for path, name in cap_names.items():
            text = re.sub(rf"{re.escape(path)}\b", f"/dev/nvidia-caps/{name}", text)
        text = re.sub(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "<uid>", text)
        # Variable names spell a uid in capitals with underscores.
        text = re.sub(r"[0-9A-F]{8}(_[0-9A-F]{4}){3}_[0-9A-F]{12}", "<UID>", text)
        # Which GPU and placement the scheduler picked is not the driver's doing.
        text = re.sub(r"\bgpu-\d+-mig-[0-9a-z]+-\d+\b", "gpu-<N>-mig-<profile>-<start>", text)
        text = re.sub(r"_GPU_\d+_MIG_[0-9A-Z]+_\d+\b", "_GPU_<N>_MIG_<PROFILE>_<START>", text)
        text = re.sub(r"_GPU_\d+\b", "_GPU_<N>", re.sub(r"\bgpu-\d+\b", "gpu-<N>", text))
        # The claim's own name (a template's claims carry a random suffix), its namespace kept.
        return re.sub(r"\bclaim=([^;/]+)/[^;]+", r"claim=\1/<claim>", text)

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


def differences(theirs: dict[str, str], ours: dict[str, str]) -> set[tuple[str, str, str]]:
    """(what was seen, NVIDIA's value, flexgpu's value) wherever two reduced reports differ."""
    return {
        (k, theirs.get(k, ABSENT), ours.get(k, ABSENT))
        for k in theirs.keys() | ours.keys()
        if theirs.get(k, ABSENT) != ours.get(k, ABSENT)
    }


def documented(start: str, end: str, cells: int) -> dict[tuple[str, ...], str]:
    """The rows of the table between ``start`` and ``end`` in docs/nvidia-differential.md:
    the first ``cells - 1`` cells (code quotes dropped) -> the last one, the reason."""
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index(start) + len(start) : text.index(end)]
    rows: dict[tuple[str, ...], str] = {}
    for line in table.splitlines():
        found = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(found) != cells or found[0] in ("", "Claim", "Manifest") or set(found[0]) <= {"-"}:
            continue
        rows[tuple(found[:-1])] = found[-1]
    return rows
