"""Pod created -> container running on the real node, flexgpu's plugin (the chart's DaemonSet)
against NVIDIA's own DRA kubelet plugin (sigs.k8s.io/dra-driver-nvidia-gpu v0.4.1, its chart's
gates: none) on the same node: one whole GPU per pod, pods one after another and 8 at once.

    python -m bench.nvidia_pod_start [--pods 30]

The method is bench.pod_start's (the same pods, claims, watch, clean-up between batches, the
drivers taking turns batch by batch, each pod's phases from containerd's log and the run times
of runc, the CDI hooks and ldconfig from the kernel's process events); only the competitor
differs. Both give containers the driver the same way (NVIDIA's toolkit generates both specs),
so where the reference driver's containers get no driver at all, this comparison shows what
the CUDA payload costs under NVIDIA's own driver. NVIDIA's plugin runs inside the node's
namespaces as its DaemonSet would (tools/nvidia_twin/node_plugin.py), over the NVML mock
library serving a DGX H100 (eight whole GPUs); flexgpu's serves the node's hgx-h100-8
topology. Both plugins are registered with the kubelet through the whole run; each driver's
pods ask for its own DeviceClass. Nothing is
asserted: the tables show each figure and the ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.compare_table import Row, percentile, render
from bench.pod_start import Starts, measure_side_by_side
from bench.pod_start_node import NAMESPACE, NODE, PLUGIN_NAMESPACE, TOPOLOGY, WHOLE_GPUS
from bench.pod_start_report import AT_ONCE, report
from tests.nvidia_ctk import tools_dir
from tests.nvidia_machine import machine
from tests.nvml_library import ENV_CONFIG, ENV_STATE
from tools.cluster import ControlPlane
from tools.cluster.process import Component
from tools.node import chart
from tools.node.node import RealNode
from tools.nvidia_twin import CHART_GATES, NVIDIA_DRIVER, node_plugin, nvidia_plugin_binary

FLEXGPU_CLASS = "gpu.flexgpu.dev"


def _wait_serving(node: RealNode, plugin: Component, timeout_s: float = 120) -> None:
    """Until the kubelet registered NVIDIA's plugin and its slices are published."""
    resource: Any = client.ResourceV1Api(node.api)
    selector = f"spec.driver={NVIDIA_DRIVER},spec.nodeName={node.name}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not plugin.running():
            raise RuntimeError(f"NVIDIA's plugin exited:\n{plugin.log_tail(40)}")
        if (
            node.plugin_registered(NVIDIA_DRIVER)
            and resource.list_resource_slice(field_selector=selector).items
        ):
            return
        time.sleep(0.5)
    raise TimeoutError(f"NVIDIA's plugin not serving:\n{plugin.log_tail(40)}")


def rows(flexgpu: Starts, nvidia: Starts) -> list[Row]:
    return [
        Row(f"pod start p{p} s, {mode}", percentile(mine, p), percentile(theirs, p), 2)
        for mode, mine, theirs in (
            ("one at a time", flexgpu.sequential_s, nvidia.sequential_s),
            (f"{AT_ONCE} at once", flexgpu.concurrent_s, nvidia.concurrent_s),
        )
        for p in (50, 90, 99)
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=30, help="pods per driver and mode")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="nvidia-pod-start-"))
    with ControlPlane() as plane:
        node = RealNode(plane, NODE, gpus=8, labels={"flexgpu.dev/topology": TOPOLOGY})
        node.start()
        nvidia: Component | None = None
        try:
            api = node.api
            core: Any = client.CoreV1Api(api)
            core.create_namespace({"metadata": {"name": NAMESPACE}})
            image = node.flexgpu_image
            chart.install(
                node,
                release="flexgpu",
                namespace=PLUGIN_NAMESPACE,
                image=image,
                topology=TOPOLOGY,
                # GPUs 6 and 7 start in MIG mode: published whole too, for 8 whole GPUs at once.
                extra=WHOLE_GPUS,
            )
            chart.wait_plugin_serving(node, PLUGIN_NAMESPACE, image=image)
            made = machine(work / "machine", mig_layouts=False)
            nvidia = node_plugin.start(
                node,
                work / "nvidia-plugin",
                binary=nvidia_plugin_binary(),
                cdi_hook=tools_dir() / "nvidia-cdi-hook",
                machine_env={k: v for k, v in made.env().items() if k in (ENV_CONFIG, ENV_STATE)},
                feature_gates=CHART_GATES,
            )
            print(f"NVIDIA plugin log: {work / 'nvidia-plugin' / 'plugin.log'}", flush=True)
            node_plugin.create_device_classes(api)
            _wait_serving(node, nvidia)
            measured = measure_side_by_side(
                api,
                {"flexgpu": FLEXGPU_CLASS, "nvidia": NVIDIA_DRIVER},
                image=node.images["pause"].name,
                pods=args.pods,
                kubelet_state=node.layout.kubelet_dir / "dra_manager_state",
                containerd_log=node.layout.logs / "containerd.log",
            )
        finally:
            if nvidia is not None:
                nvidia.stop()
            node.cleanup()
    print(
        "\nPod created -> container running, one whole GPU per pod, real node (kubelet v1.37, "
        "containerd, runc), ratio = flexgpu / NVIDIA\n"
    )
    print(render(rows(measured["flexgpu"], measured["nvidia"]), reference="nvidia"))
    print("\n" + report(measured, None))
    print(
        f"\n{args.pods} pods one at a time and {AT_ONCE * -(-args.pods // AT_ONCE)} "
        f"{AT_ONCE} at a time per driver, "
        f"after one warm-up pod. Load average (1 min): {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
