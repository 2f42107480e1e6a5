"""The real node as bench.pod_start sets it up: names, the chart values of each flexgpu
variant, the reference driver started on the host (--example-on-host; by default its chart
deploys it: tools/node/example_chart.py), and plugin roll-outs between variants."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.plugins import example_binary
from tools.node import chart
from tools.node.node import RealNode

NODE = "real-gpu-node"
TOPOLOGY = "hgx-h100-8"
NAMESPACE = "podstart"
PLUGIN_NAMESPACE = "flexgpu-system"
EXAMPLE_DRIVER = "gpu.example.com"
MIG_GPUS = "4,5"
# Helm splits --set values at commas: the list's own are escaped.
MIG_GPUS_SET = MIG_GPUS.replace(",", "\\,")
MIG_CLASS = "mig.flexgpu.dev"
# The topology starts GPUs 6 and 7 in MIG mode, which flexgpu publishes as MIG devices only
# (a GpuNodePolicy could say otherwise, but its admission webhook needs the controller, which
# the real node does not run): as dynamic-MIG GPUs they are published whole too, so that 8
# pods can each get a whole GPU at once, as the reference driver's 8 devices can. A pod given
# GPU 6 or 7 waits for MIG mode to be switched off at prepare.
WHOLE_GPUS = ("--set-string", "kubeletPlugin.dynamicMigGpus=6\\,7")
POD_TIMEOUT_S = 180.0


def example_class(api: Any) -> None:
    """The reference driver's DeviceClass, for the host process (its chart makes its own)."""
    resource: Any = client.ResourceV1Api(api)
    selector = f"device.driver == '{EXAMPLE_DRIVER}'"
    resource.create_device_class(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": EXAMPLE_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": selector}}]},
        }
    )


def start_example(node: RealNode, kubeconfig: Path, log: Path) -> subprocess.Popen[bytes]:
    kubelet = node.layout.kubelet_dir
    return subprocess.Popen(
        [
            str(example_binary()),
            f"--node-name={NODE}",
            "--num-devices=8",
            f"--cdi-root={node.layout.cdi_dir}",
            f"--kubelet-registrar-directory-path={kubelet / 'plugins_registry'}",
            f"--kubelet-plugins-directory-path={kubelet / 'plugins'}",
            f"--kubeconfig={kubeconfig}",
            "--kube-api-qps=1000",
            "--kube-api-burst=1000",
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())},
    )


def wait_registered(node: RealNode, driver: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not node.plugin_registered(driver):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{driver} not registered with the kubelet\n{node.log_tails()}")
        time.sleep(0.5)


def roll_plugin(node: RealNode, image: str, extra: tuple[str, ...]) -> None:
    """Upgrades the chart with ``extra`` values and waits until a new plugin pod serves and
    the one before it is gone."""
    before = {p.metadata.name for p in chart.plugin_pods(node.api, PLUGIN_NAMESPACE, node.name)}
    chart.install(
        node,
        release="flexgpu",
        namespace=PLUGIN_NAMESPACE,
        image=image,
        topology=TOPOLOGY,
        extra=extra,
    )
    deadline = time.monotonic() + POD_TIMEOUT_S
    while {p.metadata.name for p in chart.plugin_pods(node.api, PLUGIN_NAMESPACE, node.name)} & (
        before
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"plugin pods {sorted(before)} still there after the upgrade")
        time.sleep(0.5)
    chart.wait_plugin_serving(node, PLUGIN_NAMESPACE, image=image)


def variant_values(node: RealNode, variant: str) -> tuple[str, ...]:
    """The chart values of a flexgpu variant (see the module's docstring)."""
    if variant == "separate-hooks":
        # The copy the plugin installed on its first start: named, it is used as is and
        # flexgpu-cdi-hooks is not (driver_edits.py).
        hook = node.layout.kubelet_dir / "plugins" / "gpu.flexgpu.dev" / "bin" / "nvidia-cdi-hook"
        return (*WHOLE_GPUS, "--set-string", f"kubeletPlugin.nvidiaCdiHookPath={hook}")
    if variant == "no-driver":
        return (*WHOLE_GPUS, "--set-string", "kubeletPlugin.nvidiaDriverRoot=")
    return WHOLE_GPUS
