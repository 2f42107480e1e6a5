"""The demo's GPU load: every running catalog pod gets a simulated process on each device of
its claims (written to the simulated node's usage file, driver/sim_usage.py), except the
pods of one deliberately idle claim, so that `flexgpu usage` has busy claims and an idle one
to tell apart. Each process gets a ``/proc/<pid>/cgroup`` file under the node's fake proc
root naming its pod's UID, which is how the plugin tells the pods of a shared GPU apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from demo.catalog import NAMESPACE, claim_names
from flexgpu.driver.sim_usage import USAGE_FILE_NAME

# The pod whose claim stays idle: one whole A100 picked by its memory size.
IDLE_POD = "mid-memory"
# Short enough for the demo to show it: a claim idle this long is listed as idle.
IDLE_WINDOW = "20s"
BUSY_PERCENT = 70
# A share's pod stays within its share: this much of its compute percentage, or this much of
# the GPU when the share sets no compute.
SHARE_BUSY = 0.7
SHARE_BUSY_PERCENT = 20
STATE_FILE = "simulated-gpus.json"
FIRST_PID = 50000


def plugin_env(node_root: Path, port: int) -> dict[str, str]:
    """What a simulated node's plugin needs to serve metrics and sample usage every second."""
    return {
        **os.environ,
        "FLEXGPU_METRICS_PORT": str(port),
        "FLEXGPU_METRICS_ADDRESS": "127.0.0.1",
        "FLEXGPU_USAGE_INTERVAL": "1",
        "FLEXGPU_IDLE_WINDOW": IDLE_WINDOW,
        "FLEXGPU_PROC_ROOT": str(proc_root(node_root)),
    }


def proc_root(node_root: Path) -> Path:
    return node_root / "proc"


def _gpu_instances(data_dir: Path) -> dict[str, tuple[int, int]]:
    """MIG UUID -> (GPU index, GPU instance ID), from the simulated node's state file."""
    path = data_dir / STATE_FILE
    if not path.exists():
        return {}
    state = json.loads(path.read_text())
    return {
        m["uuid"]: (index, m["gpu_instance_id"])
        for index, gpu in enumerate(state.get("gpus", []))
        for m in gpu.get("mig_instances", [])
    }


def _claim_devices(claim: Any) -> list[tuple[str, str, str, int]]:
    """(node pool, device, status uuid, SM percent to load it with) of each non-admin
    device of an allocated claim."""
    status = claim.status
    if status is None or status.allocation is None:
        return []
    data = {(d.pool, d.device): d.data or {} for d in status.devices or []}
    found = []
    for r in status.allocation.devices.results:
        if r.admin_access:
            continue
        info = data.get((r.pool, r.device), {})
        percent = BUSY_PERCENT
        if "granted" in info:
            text = str(info["granted"].get("compute", "0"))
            compute = int(text) if text.isdigit() else 0
            percent = int(compute * SHARE_BUSY) if compute else SHARE_BUSY_PERCENT
        found.append((r.pool, r.device, str(info.get("uuid", "")), percent))
    return found


def apply_load(api: Any, node_roots: dict[str, Path], namespace: str = NAMESPACE) -> list[str]:
    """Writes each node's usage file and fake proc entries for the running pods; returns the
    idle claim's name(s)."""
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)
    gpus: dict[str, dict[str, list[dict[str, int]]]] = {name: {} for name in node_roots}
    instances = {name: _gpu_instances(root / "plugin-data") for name, root in node_roots.items()}
    idle: list[str] = []
    pid = FIRST_PID
    for pod in core.list_namespaced_pod(namespace).items:
        if pod.status.phase != "Running":
            continue
        for claim_name in claim_names(pod):
            if pod.metadata.name == IDLE_POD:
                idle.append(claim_name)
                continue
            claim = resource.read_namespaced_resource_claim(claim_name, namespace)
            for node, device, uuid, percent in _claim_devices(claim):
                if node not in node_roots:
                    continue
                process: dict[str, int] = {
                    "pid": pid,
                    "usedMemoryMiB": 1024,
                    "smUtilization": percent,
                }
                index = int(device.split("-")[1])
                if uuid in instances[node]:
                    index, process["gpuInstanceId"] = instances[node][uuid]
                gpus[node].setdefault(str(index), []).append(process)
                entry = proc_root(node_roots[node]) / str(pid)
                entry.mkdir(parents=True, exist_ok=True)
                (entry / "cgroup").write_text(
                    f"0::/kubepods/besteffort/pod{pod.metadata.uid}/main\n"
                )
                pid += 1
    for node, loads in gpus.items():
        path = node_roots[node] / "plugin-data" / USAGE_FILE_NAME
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"gpus": {i: {"processes": p} for i, p in loads.items()}}))
        os.replace(tmp, path)
    return idle


def usage_report(endpoints: list[str], kubeconfig: Path) -> str:
    """`flexgpu usage -A -o wide` over the plugins' endpoints, as a user would run it."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexgpu.controller.cli",
            "usage",
            "-A",
            f"--kubeconfig={kubeconfig}",
            f"--idle-window={IDLE_WINDOW}",
            "-o",
            "wide",
            *(f"--plugin={e}" for e in endpoints),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.stdout + proc.stderr


def wait_idle_listed(
    endpoints: list[str], kubeconfig: Path, idle: list[str], timeout_s: float = 90
) -> str:
    """`flexgpu usage` once the idle claim is listed as idle (the window has passed), or
    the last report when it is not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    report = usage_report(endpoints, kubeconfig)
    while time.monotonic() < deadline:
        section = report.partition("Idle claims:")[2]
        if idle and all(name in section for name in idle):
            return report
        time.sleep(2)
        report = usage_report(endpoints, kubeconfig)
    return report
