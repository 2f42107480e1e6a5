"""How fast the kubelet plugin comes up, and how much memory it then holds.

    python -m tools.plugin_startup [--runs 5] [--kubeconfig PATH] [--topology hgx-h100-8]
                                   [--source CHECKOUT]

For each run a fresh plugin process (simulated GPUs) is started and timed from exec to:
the DRA socket answering a gRPC call (an empty NodePrepareResources, as a liveness probe
sends; also the CPU time the plugin used until then, which a busy machine does not inflate),
the registration socket answering GetInfo, and its first ResourceSlice being readable from
the API server. Its resident memory is read once the slices are up and it has
settled. Without --kubeconfig a local control plane is started for the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from flexgpu.kubelet_plugin.api.kube_api import KubeApi, path_of
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.pluginregistration.v1 import registration_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra.v1 import dra_pb2_grpc
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.pluginregistration.v1 import (
    registration_pb2_grpc,
)

DRIVER = "gpu.flexgpu.dev"
NODE = "startup-node"
SETTLE_S = 3.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """CPU time the process has used (user + system): unlike wall time, not inflated by
    other work on a busy machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _answers(call: Any, request: Any) -> bool:
    try:
        call(request, timeout=0.2)
        return True
    except grpc.RpcError:
        return False


def our_slices(api: KubeApi) -> list[dict[str, Any]]:
    listed = api.get(
        path_of("apis", "resource.k8s.io", "v1", "resourceslices"),
        {"fieldSelector": f"spec.nodeName={NODE},spec.driver={DRIVER}"},
    )
    items: list[dict[str, Any]] = listed.get("items") or []
    return items


def delete_slices(api: KubeApi) -> None:
    for item in our_slices(api):
        api.request(
            "DELETE",
            path_of("apis", "resource.k8s.io", "v1", "resourceslices", item["metadata"]["name"]),
        )


def one_run(
    kubeconfig: Path, topology: str, source: Path | None = None, timeout_s: float = 60
) -> dict[str, float]:
    api = KubeApi.from_kubeconfig(kubeconfig)
    delete_slices(api)
    root = Path(tempfile.mkdtemp(prefix="fgs-", dir="/tmp"))  # short: socket path limit
    dra_socket = root / "plugins" / DRIVER / "dra.sock"
    reg_socket = root / "reg" / f"{DRIVER}-reg.sock"
    argv = [
        sys.executable,
        "-m",
        "flexgpu.kubelet_plugin.main",
        "--gpu-backend=simulated",
        f"--topology={topology}",
        f"--node-name={NODE}",
        f"--kubeconfig={kubeconfig}",
        f"--registry-dir={root / 'reg'}",
        f"--plugins-dir={root / 'plugins'}",
        f"--cdi-dir={root / 'cdi'}",
        f"--data-dir={root / 'data'}",
    ]
    marks: dict[str, float] = {}
    log = (root / "plugin.log").open("wb")
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=source)
    try:
        dra = grpc.insecure_channel(f"unix://{dra_socket}")
        reg = grpc.insecure_channel(f"unix://{reg_socket}")
        probe = dra_pb2_grpc.DRAPluginStub(dra).NodePrepareResources
        info = registration_pb2_grpc.RegistrationStub(reg).GetInfo
        deadline = start + timeout_s
        while len(marks) < 4 and time.perf_counter() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"plugin exited with {proc.returncode}; log {log.name}")
            now = time.perf_counter
            if (
                "dra_socket_s" not in marks
                and dra_socket.exists()
                and _answers(probe, dra_pb2.NodePrepareResourcesRequest())
            ):
                marks["dra_socket_s"] = now() - start
                marks["dra_socket_cpu_s"] = cpu_s(proc.pid)
            if (
                "registration_socket_s" not in marks
                and reg_socket.exists()
                and _answers(info, registration_pb2.InfoRequest())
            ):
                marks["registration_socket_s"] = now() - start
            if "first_slice_s" not in marks and "dra_socket_s" in marks and our_slices(api):
                marks["first_slice_s"] = now() - start
            time.sleep(0.002)
        if len(marks) < 4:
            raise RuntimeError(f"plugin not up after {timeout_s}s ({marks}); log {log.name}")
        time.sleep(SETTLE_S)
        marks["rss_mib"] = rss_mib(proc.pid)
        dra.close()
        reg.close()
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        shutil.rmtree(root, ignore_errors=True)
        api.close()
    return marks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kubeconfig", type=Path)
    parser.add_argument("--topology", default="hgx-h100-8")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--source",
        type=Path,
        help="run the plugin from this checkout instead (e.g. an older commit, to compare)",
    )
    args = parser.parse_args()

    def measure(kubeconfig: Path) -> list[dict[str, float]]:
        from kubernetes import config

        from tools.cluster.nodes import create_simulated_node

        create_simulated_node(config.new_client_from_config(config_file=str(kubeconfig)), NODE)
        return [one_run(kubeconfig, args.topology, args.source) for _ in range(args.runs)]

    if args.kubeconfig is not None:
        runs = measure(args.kubeconfig)
    else:
        from tools.cluster import ControlPlane

        with ControlPlane() as plane:
            runs = measure(plane.kubeconfig)
    keys = ("dra_socket_s", "dra_socket_cpu_s", "registration_socket_s", "first_slice_s", "rss_mib")
    summary = {
        k: {"median": statistics.median(r[k] for r in runs), "max": max(r[k] for r in runs)}
        for k in keys
    }
    if args.json:
        print(json.dumps({"runs": runs, "summary": summary}, indent=2))
        return 0
    print(f"kubelet plugin start-up, {args.runs} runs, simulated {args.topology}:")
    for key in keys:
        unit = "MiB" if key == "rss_mib" else "s"
        print(
            f"  {key:22s} median {summary[key]['median']:7.3f} {unit}"
            f"   max {summary[key]['max']:7.3f} {unit}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
