"""A simulated GPU node: a Node object, flexgpu's kubelet plugin on the simulated backend, and
the kubelet harness (upstream plugin manager + DRA manager) acting as its kubelet."""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes import client, config

from tools.cluster.binaries import harness_binary
from tools.cluster.nodes import create_simulated_node, mark_node_ready
from tools.cluster.process import Component

DRIVER = "gpu.flexgpu.dev"


class NodeError(RuntimeError):
    pass


class SimulatedGpuNode:
    def __init__(
        self,
        kubeconfig: Path,
        name: str,
        topology: str,
        *,
        root: Path | None = None,
        plugin_args: tuple[str, ...] = (),
        plugin_env: dict[str, str] | None = None,
        plugin_kubeconfig: Path | None = None,
        create_node: bool = True,
        feature_gates: str = "",
    ) -> None:
        self.kubeconfig = kubeconfig
        self.name = name
        self.topology = topology
        # Unix socket paths are capped at 107 bytes: keep the root short.
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="fg-", dir="/tmp"))
        self.plugin_args = plugin_args
        self.plugin_env = plugin_env
        # The plugin may act as a ServiceAccount (the chart's) instead of the admin.
        self.plugin_kubeconfig = plugin_kubeconfig or kubeconfig
        self.api: Any = config.new_client_from_config(config_file=str(kubeconfig))
        self.harness: Component | None = None
        self.plugin: Component | None = None
        self.plugin_starts = 0
        # False: the Node exists already (an autoscaler created it); it is only reported Ready.
        self.create_node = create_node
        # The harness's kubelet gates (ControlPlane.feature_gates): its DRA manager accepts a
        # claim reserved for the pod's PodGroup only with DRAWorkloadResourceClaims on.
        self.feature_gates = feature_gates

    # -- paths -------------------------------------------------------------------------
    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def data_dir(self) -> Path:
        return self.root / "plugin-data"

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        path = self.root / "kubelet" / "pods" / f"{namespace}_{pod}" / f"{container}.log"
        return path.read_text() if path.exists() else ""

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> None:
        # A topology file is labelled by its name: a path is no label value.
        label = Path(self.topology).stem if "/" in self.topology else self.topology
        if self.create_node:
            create_simulated_node(self.api, self.name, labels={"flexgpu.dev/topology": label})
        else:
            mark_node_ready(self.api, self.name)
        self.harness = Component(
            f"kubelet-harness[{self.name}]",
            [
                str(harness_binary()),
                f"--kubeconfig={self.kubeconfig}",
                f"--node-name={self.name}",
                f"--root-dir={self.root / 'kubelet'}",
                f"--registry-dir={self.root / 'registry'}",
                f"--plugins-dir={self.root / 'plugins'}",
                f"--cdi-dir={self.cdi_dir}",
                "--sync-backoff-max=2s",
                *([f"--feature-gates={self.feature_gates}"] if self.feature_gates else []),
            ],
            self.root / "logs" / "kubelet-harness.log",
        )
        self.harness.start()
        self._wait(
            lambda: "READY" in self.harness.log_tail(1000).splitlines(),
            self.harness,
            timeout_s,
            "harness READY",
        )
        self.start_plugin(timeout_s)

    def start_plugin(self, timeout_s: float = 60) -> None:
        self.plugin_starts += 1
        self.plugin = Component(
            f"flexgpu-kubelet-plugin[{self.name}]",
            [
                sys.executable,
                "-m",
                "flexgpu.kubelet_plugin.main",
                "--gpu-backend=simulated",
                f"--topology={self.topology}",
                f"--node-name={self.name}",
                f"--kubeconfig={self.plugin_kubeconfig}",
                f"--registry-dir={self.root / 'registry'}",
                f"--plugins-dir={self.root / 'plugins'}",
                f"--cdi-dir={self.cdi_dir}",
                f"--data-dir={self.data_dir}",
                *self.plugin_args,
            ],
            self.root / "logs" / f"plugin-{self.plugin_starts}.log",
            env=self.plugin_env,
        )
        self.plugin.start()
        self._wait(self.registered, self.plugin, timeout_s, "plugin registered with the harness")

    def registered(self) -> bool:
        """The harness's plugin manager has registered a live plugin and slices are up."""
        slices = (
            client.ResourceV1Api(self.api)
            .list_resource_slice(field_selector=f"spec.nodeName={self.name},spec.driver={DRIVER}")
            .items
        )
        log = self.plugin.log_tail(200) if self.plugin else ""
        return bool(slices) and "registered with the kubelet" in log

    def stop_plugin(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.plugin is None:
            return
        if sig == signal.SIGKILL and self.plugin.proc is not None:
            self.plugin.proc.kill()
            self.plugin.proc.wait(10)
        else:
            self.plugin.stop()

    def stop(self) -> None:
        self.stop_plugin()
        if self.harness:
            self.harness.stop()

    def cleanup(self) -> None:
        """Stops the node and removes it from the cluster with its slices, so no later test
        sees devices that no plugin serves."""
        self.stop()
        resource: Any = client.ResourceV1Api(self.api)
        with contextlib.suppress(client.ApiException):
            resource.delete_collection_resource_slice(field_selector=f"spec.nodeName={self.name}")
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(self.api).delete_node(self.name)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def _wait(self, ready: Any, component: Component, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not component.running():
                raise NodeError(
                    f"{component.name} exited with code {component.exit_code()} before {what}; "
                    f"log {component.log_path}:\n{component.log_tail()}"
                )
            if ready():
                return
            time.sleep(0.1)
        raise NodeError(
            f"{component.name}: no {what} after {timeout_s:.0f}s; "
            f"log {component.log_path}:\n{component.log_tail()}"
        )
