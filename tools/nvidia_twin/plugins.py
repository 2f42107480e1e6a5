"""How each twin's kubelet plugin is started on its own simulated node, and how its published
ResourceSlices are awaited. Both read the same machine through the same libnvidia-ml.so.1 (the
NVML mock library) in the same driver root; each node has its own state file, so neither sees
what the other changes."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from tools import buildcache
from tools.cluster.nodes import create_simulated_node
from tools.cluster.process import Component

REPO = Path(__file__).resolve().parents[2]
NVIDIA_DRIVER = "gpu.nvidia.com"
FLEXGPU_DRIVER = "gpu.flexgpu.dev"
# NVIDIA's chart ships no gates on; the ones a GPU user turns on, as far as the plugin lets them
# be combined: DynamicMIG excludes MPSSupport and NVMLDeviceHealthCheck in v0.4.1.
CHART_GATES = ""
STATIC_GATES = "TimeSlicingSettings=true,MPSSupport=true,NVMLDeviceHealthCheck=true"
DYNAMIC_MIG_GATES = "DynamicMIG=true,TimeSlicingSettings=true"
# Only used to render MPS control-daemon Deployments; nothing pulls it here.
NVIDIA_IMAGE = "registry.k8s.io/dra-driver-nvidia-gpu/dra-driver-nvidia-gpu:v0.4.1"


def nvidia_plugin_binary() -> Path:
    """Builds NVIDIA's gpu-kubelet-plugin (or finds it cached); its path."""
    return buildcache.path("nvidia-driver", stream=True) / "gpu-kubelet-plugin"


@dataclass
class TwinPlugin:
    """One kubelet plugin on one simulated node; slices are read from the API server."""

    label: str
    driver: str
    node: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    dirs: list[Path] = field(default_factory=list)
    component: Component | None = None

    def start(self, api: Any) -> None:
        create_simulated_node(api, self.node)
        for folder in self.dirs:
            folder.mkdir(parents=True, exist_ok=True)
        self.component = Component(f"{self.label}[{self.node}]", self.argv, self.log, self.env)
        self.component.start()

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()
            self.component = None

    def remove(self, api: Any) -> None:
        """Stops the plugin and takes its node and slices out of the cluster, so that tests
        sharing the control plane do not count them."""
        self.stop()
        resource: Any = client.ResourceV1Api(api)
        resource.delete_collection_resource_slice(
            field_selector=f"spec.driver={self.driver},spec.nodeName={self.node}"
        )
        for item in resource.list_resource_slice(field_selector=f"spec.driver={self.driver}").items:
            if item.spec.node_name is None and item.spec.pool.name == self.node:
                resource.delete_resource_slice(item.metadata.name)
        try:
            client.CoreV1Api(api).delete_node(self.node)
        except client.ApiException as err:
            if err.status != 404:  # the other twin of the pair may share it
                raise

    def slices(self, api: Any) -> list[Any]:
        resource: Any = client.ResourceV1Api(api)
        selector = f"spec.driver={self.driver},spec.nodeName={self.node}"
        items: list[Any] = resource.list_resource_slice(field_selector=selector).items
        # Slices without a node (shared counters, 1.35+) belong to the pool named after it.
        for item in resource.list_resource_slice(field_selector=f"spec.driver={self.driver}").items:
            if item.spec.node_name is None and item.spec.pool.name == self.node:
                items.append(item)
        return items

    def wait_published(self, api: Any, timeout_s: float = 120, settle_s: float = 3) -> list[Any]:
        """The node's slices once they exist and their generations stay unchanged for
        ``settle_s``; a plugin that exits or publishes nothing in time is an error with its log."""
        deadline = time.monotonic() + timeout_s
        last: tuple[tuple[str, str], ...] = ()
        stable_since = time.monotonic()
        while time.monotonic() < deadline:
            if self.component is None or not self.component.running():
                code = self.component.exit_code() if self.component else None
                tail = self.component.log_tail(60) if self.component else ""
                raise RuntimeError(f"{self.label} plugin exited ({code}); log {self.log}:\n{tail}")
            current = self.slices(api)
            key = tuple(
                sorted((s.metadata.name, s.metadata.resource_version or "") for s in current)
            )
            if key != last:
                last, stable_since = key, time.monotonic()
            elif current and time.monotonic() - stable_since >= settle_s:
                return current
            time.sleep(0.5)
        tail = self.component.log_tail(60) if self.component else ""
        raise RuntimeError(
            f"{self.label} on {self.node}: no settled ResourceSlices in {timeout_s:.0f}s; "
            f"log {self.log}:\n{tail}"
        )


def nvidia_twin(
    binary: Path,
    node: str,
    root: Path,
    kubeconfig: Path,
    *,
    driver_root: Path,
    cdi_hook: Path,
    machine_env: dict[str, str],
    feature_gates: str,
) -> TwinPlugin:
    """NVIDIA's plugin as its DaemonSet runs it, the driver root mounted where the chart mounts
    it (here: the same folder for host and container); ``feature_gates`` empty: none, as its
    chart sets them."""
    plugins = root / "plugins"
    registry = root / "registry"
    return TwinPlugin(
        label="nvidia",
        driver=NVIDIA_DRIVER,
        node=node,
        argv=[
            str(binary),
            f"--node-name={node}",
            f"--kubeconfig={kubeconfig}",
            f"--cdi-root={root / 'cdi'}",
            f"--nvidia-driver-root={driver_root}",
            f"--container-driver-root={driver_root}",
            f"--nvidia-cdi-hook-path={cdi_hook}",
            f"--image-name={NVIDIA_IMAGE}",
            f"--kubelet-registrar-directory-path={registry}",
            f"--kubelet-plugins-directory-path={plugins}",
            *([f"--feature-gates={feature_gates}"] if feature_gates else []),
            "-v=4",
        ],
        # Its flags also read environment variables (KUBECONFIG, NODE_NAME, ...): none leak in.
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(Path.home()),
            **machine_env,
        },
        log=root / "nvidia.log",
        dirs=[plugins, registry, root / "cdi"],
    )


def flexgpu_twin(
    node: str,
    root: Path,
    kubeconfig: Path,
    *,
    driver_root: Path,
    cdi_hook: Path,
    machine_env: dict[str, str],
    dynamic_mig: bool,
) -> TwinPlugin:
    """flexgpu's plugin on the NVML backend over the same driver root; with ``dynamic_mig``
    every GPU is partitioned on demand, as NVIDIA's DynamicMIG gate does."""
    argv = [
        sys.executable,
        "-m",
        "flexgpu.kubelet_plugin.main",
        "--gpu-backend=nvml",
        f"--node-name={node}",
        f"--kubeconfig={kubeconfig}",
        f"--registry-dir={root / 'registry'}",
        f"--plugins-dir={root / 'plugins'}",
        f"--cdi-dir={root / 'cdi'}",
        f"--data-dir={root / 'data'}",
        f"--driver-root={driver_root}",
        f"--nvidia-cdi-hook={cdi_hook}",
    ]
    if dynamic_mig:
        argv.append("--dynamic-mig-gpus=all")
    return TwinPlugin(
        label="flexgpu",
        driver=FLEXGPU_DRIVER,
        node=node,
        argv=argv,
        # flexgpu-cdi-common (the driver's common CDI edits) comes from the hook's folder.
        env={
            **os.environ,
            **machine_env,
            "PATH": f"{cdi_hook.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        },
        log=root / "flexgpu.log",
        dirs=[root / "registry", root / "plugins", root / "cdi", root / "data"],
    )
