"""A real node for the local control plane: the upstream kubelet on containerd (CRI with
CDI) and runc, in namespaces of its own, with a simulated NVIDIA driver root, joined with a
node client certificate. The kubelet harness stays for the fast tests; this node is for what
only a real kubelet and runtime show: what containers receive, checkpoints, restarts."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client

from release.layers import BuiltImage
from tools import buildcache
from tools.cluster.binaries import control_plane_dir
from tools.cluster.control_plane import ControlPlane, free_port
from tools.cluster.feature_gates import settable_gates
from tools.cluster.process import Component
from tools.images.build import build_all
from tools.node import cgroups, configs, credentials, driver_root, namespace, reaper
from tools.node.binaries import node_binaries
from tools.node.image_source import ImageSource

GPU_LABEL = "nvidia.com/gpu.present"


class RealNodeError(RuntimeError):
    """A node component failed; the message names it and carries its log tail."""


# Logged every few seconds by a kubelet whose node has no address (by design here): it
# would fill every log tail.
_NOISE = ("no default routes found",)


def _tail(component: Component, lines: int = 30) -> str:
    kept = [
        line for line in component.log_tail(2000).splitlines() if not any(n in line for n in _NOISE)
    ]
    return "\n".join(kept[-lines:])


def _nvml_mock_library() -> Path | None:
    """libnvidia-ml.so.1 over NVIDIA's mock NVML servers (tools/nvml-mock), when this tree
    has it; the driver root installs it where the driver puts NVML."""
    if not buildcache.SCRIPTS["nvml-mock"].exists():
        return None
    try:
        library = buildcache.path("nvml-mock", timeout=900) / "libnvidia-ml.so.1"
    except buildcache.BuildError as e:
        raise RealNodeError(f"building the NVML mock library failed: {e}") from e
    return library if library.is_file() else None


class RealNode:
    def __init__(
        self,
        cluster: ControlPlane,
        name: str,
        *,
        gpus: int = 4,
        labels: dict[str, str] | None = None,
        root: Path | None = None,
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.gpus = gpus
        self.labels = {GPU_LABEL: "true", **(labels or {})}
        self._own_root = root is None
        # Unix socket paths are capped at 107 bytes: keep the root short.
        self.layout = configs.NodeLayout(root or Path(tempfile.mkdtemp(prefix="fgn-", dir="/tmp")))
        # Unique per node instance: two test runs on one machine must never share (or clean
        # up) each other's pod cgroups.
        self.cgroup_root = f"/flexgpu-node-{self.layout.root.name}"
        self.api: Any = cluster.api_client()
        self.images: dict[str, BuiltImage] = {}
        # The flexgpu image as the chart pulls it: pushed to the node's local registry.
        self.image_source = ImageSource(self.layout, name)
        self.flexgpu_image = ""
        self.bin_dir = Path()
        self.holder: Component | None = None
        self.forwarder: Component | None = None
        self.containerd: Component | None = None
        self.kubelet: Component | None = None
        self.daemonsets: Component | None = None
        self.driver: driver_root.DriverRoot | None = None
        self._kubelet_starts = 0
        self._containerd_starts = 0

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout_s: float = 180.0) -> None:
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> None:
        layout = self.layout
        reaper.reap_stale_nodes()
        self.bin_dir = node_binaries()
        self.prepare_images()
        for d in (layout.logs, layout.cni_conf_dir, layout.cdi_dir, layout.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        self.driver = driver_root.create(layout.driver_root, self.gpus, _nvml_mock_library())
        driver_root.add_mig_capabilities(self.driver)

        layout.containerd_config.write_text(
            configs.containerd_config(layout, self.bin_dir, self.images["pause"].name)
        )
        (layout.cni_conf_dir / "10-flexgpu.conflist").write_text(configs.cni_config_text(layout))
        pki = self.cluster.workdir / "pki"
        cert, key = credentials.issue_node_certificate(pki, self.name, layout.root / "pki")
        server = f"https://{configs.API_SERVICE_IP}:{configs.API_SERVICE_PORT}"
        layout.kubelet_kubeconfig.write_text(configs.kubeconfig(server, pki / "ca.crt", cert, key))
        layout.kubelet_config.write_text(
            configs.kubelet_config(layout, pki / "ca.crt", self.cgroup_root, self._kubelet_gates())
        )
        cgroups.create(self.cgroup_root)

        self.holder = Component(
            f"namespace[{self.name}]",
            namespace.holder_argv(layout.driver_root / "dev", layout.root / "ns"),
            layout.logs / "namespace.log",
        )
        self.holder.start()
        self._wait(
            lambda: namespace.READY in self.holder.log_tail(5) if self.holder else False,
            self.holder,
            30,
            "namespace set up",
        )
        # Lets a later run tell this node's leftovers from a live node's (tools/node/reaper.py);
        # written once the holder runs `sleep`, which is what the reaper looks for.
        self._pid_file.write_text(f"{self.holder_pid}\n")
        self.forwarder = Component(
            f"api-forwarder[{self.name}]",
            [
                sys.executable,
                "-m",
                "tools.node.forward",
                str(self.holder_pid),
                configs.API_SERVICE_IP,
                str(configs.API_SERVICE_PORT),
                "127.0.0.1",
                str(self.cluster.api_port),
            ],
            layout.logs / "api-forwarder.log",
        )
        self.forwarder.start()
        self._wait(
            lambda: "forwarding" in (self.forwarder.log_tail(5) if self.forwarder else ""),
            self.forwarder,
            30,
            "API forwarding",
        )
        self.image_source.forward_into(self.holder_pid)
        self.start_containerd(timeout_s)
        # The sandbox and workload images are side-loaded (they stand for images a cluster
        # already has); the flexgpu image is pulled from the registry, as a release is.
        for role, image in self.images.items():
            if role != "flexgpu":
                self.import_image(image)
        self.start_kubelet(timeout_s)
        self.start_daemonset_controller(timeout_s)

    def prepare_images(self) -> None:
        """Builds the images, starts the node's registry and pushes the flexgpu image to it
        (``flexgpu_image``, by digest). Callers that render the chart's values before the
        node starts call it first; ``start`` then does not again."""
        if self.flexgpu_image:
            return
        self.images = build_all()
        self.image_source.start()
        self.flexgpu_image = self.image_source.push(self.images["flexgpu"])

    @property
    def _pid_file(self) -> Path:
        return self.layout.root / reaper.PID_FILE

    @property
    def holder_pid(self) -> int:
        if self.holder is None or self.holder.pid is None:
            raise RealNodeError(f"node {self.name}: its namespace is not running")
        return self.holder.pid

    def _in_node(self, argv: list[str]) -> list[str]:
        return namespace.enter_argv(self.holder_pid, argv)

    def start_containerd(self, timeout_s: float = 60.0) -> None:
        self._containerd_starts += 1
        env = {**os.environ, "PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.containerd = Component(
            f"containerd[{self.name}]",
            self._in_node(
                [str(self.bin_dir / "containerd"), "--config", str(self.layout.containerd_config)]
            ),
            self.layout.logs / "containerd.log",
            env=env,
        )
        self.containerd.start()
        self._wait(self._containerd_serving, self.containerd, timeout_s, "containerd serving")

    def _containerd_serving(self) -> bool:
        if not self.layout.containerd_socket.exists():
            return False
        proc = subprocess.run(
            [str(self.bin_dir / "ctr"), "--address", str(self.layout.containerd_socket), "version"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        return proc.returncode == 0

    def stop_containerd(self) -> None:
        if self.containerd is not None:
            self.containerd.stop()

    def restart_containerd(self, timeout_s: float = 60.0) -> None:
        self.stop_containerd()
        self.start_containerd(timeout_s)

    def ctr(self, *args: str, timeout_s: float = 300) -> str:
        argv = [
            str(self.bin_dir / "ctr"),
            "--address",
            str(self.layout.containerd_socket),
            "--namespace",
            "k8s.io",
            *args,
        ]
        proc = subprocess.run(
            self._in_node(argv),
            # `ctr tasks exec` hands its stdin to the process: give it none.
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if proc.returncode != 0:
            component = self.containerd
            tail = component.log_tail() if component else ""
            raise RealNodeError(
                f"ctr {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()}\n"
                f"containerd log {self.layout.logs / 'containerd.log'}, last lines:\n{tail}"
            )
        return proc.stdout

    def import_image(self, image: BuiltImage) -> None:
        self.ctr("images", "import", "--platform", "linux/amd64", str(image.archive))

    def _kubelet_gates(self) -> dict[str, bool]:
        """The control plane's gates that the kubelet also knows (it refuses unknown ones)."""
        wanted = [g.partition("=")[0] for g in self.cluster.feature_gates.split(",") if g]
        known = settable_gates(node_binaries() / "kubelet")
        return {g: True for g in wanted if g in known}

    def start_kubelet(self, timeout_s: float = 120.0) -> None:
        self._kubelet_starts += 1
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        self.kubelet = Component(
            f"kubelet[{self.name}]",
            self._in_node(
                [
                    str(self.bin_dir / "kubelet"),
                    f"--config={self.layout.kubelet_config}",
                    f"--kubeconfig={self.layout.kubelet_kubeconfig}",
                    f"--root-dir={self.layout.kubelet_dir}",
                    f"--hostname-override={self.name}",
                    f"--node-labels={labels}",
                    "--v=2",
                ]
            ),
            self.layout.logs / f"kubelet-{self._kubelet_starts}.log",
        )
        self.kubelet.start()
        self._wait(self._node_ready, self.kubelet, timeout_s, f"node {self.name} Ready")
        self._lift_not_ready_taint()

    def stop_kubelet(self, sig: signal.Signals = signal.SIGTERM) -> None:
        kubelet = self.kubelet
        if kubelet is None or kubelet.proc is None:
            return
        if sig == signal.SIGKILL:
            kubelet.proc.kill()
            kubelet.proc.wait(10)
        else:
            kubelet.stop()

    def restart_kubelet(self, timeout_s: float = 120.0) -> None:
        self.stop_kubelet()
        self.start_kubelet(timeout_s)

    def start_daemonset_controller(self, timeout_s: float = 60.0) -> None:
        """The DaemonSet controller (the shared control plane leaves it out: its simulated
        nodes run no DaemonSet pods), as a controller manager of its own for this node."""
        shared = next(
            (c for c in self.cluster.components if c.name == "kube-controller-manager"), None
        )
        if shared is not None and any("daemonset-controller" in arg for arg in shared.argv):
            return  # the control plane runs one already; two would fight over the pods
        kcm = control_plane_dir() / "kube-controller-manager"
        gates = self.cluster.feature_gates
        self.daemonsets = Component(
            f"daemonset-controller[{self.name}]",
            [
                str(kcm),
                f"--kubeconfig={self.cluster.kubeconfig}",
                "--controllers=daemonset-controller",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                *([f"--feature-gates={gates}"] if gates else []),
            ],
            self.layout.logs / "daemonset-controller.log",
        )
        self.daemonsets.start()
        self._wait(
            lambda: (
                "Caches are synced" in self.daemonsets.log_tail(200) if self.daemonsets else False
            ),
            self.daemonsets,
            timeout_s,
            "daemonset controller started",
        )

    def stop(self) -> None:
        for component in (self.daemonsets, self.kubelet):
            if component is not None:
                component.stop()
        cgroups.kill_all(self.cgroup_root)
        for component in (self.containerd, self.forwarder):
            if component is not None:
                component.stop()
        self.image_source.stop()
        if self.holder is not None and self.holder.pid is not None:
            # Shims outlive containerd: end everything still in the node's namespace.
            for pid in namespace.pids_in_namespace(self.holder.pid):
                if pid != self.holder.pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self.holder.stop()
        cgroups.remove(self.cgroup_root)
        self._pid_file.unlink(missing_ok=True)

    def cleanup(self) -> None:
        """Stops the node and removes it, its slices and its files."""
        self.stop()
        with contextlib.suppress(client.ApiException):
            client.ResourceV1Api(self.api).delete_collection_resource_slice(
                field_selector=f"spec.nodeName={self.name}"
            )
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(self.api).delete_node(self.name)
        if self._own_root:
            shutil.rmtree(self.layout.root, ignore_errors=True)

    # -- state -------------------------------------------------------------------------
    def _node_ready(self) -> bool:
        try:
            node: Any = client.CoreV1Api(self.api).read_node(self.name)
        except client.ApiException:
            return False
        conditions = node.status.conditions or []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    def _lift_not_ready_taint(self) -> None:
        # Admission taints a new node not-ready; the node lifecycle controller, which would
        # lift it, does not run in the local control plane.
        core = client.CoreV1Api(self.api)
        node: Any = core.read_node(self.name)
        taints = [t for t in (node.spec.taints or []) if t.key != "node.kubernetes.io/not-ready"]
        if len(taints) != len(node.spec.taints or []):
            core.patch_node(self.name, {"spec": {"taints": taints or None}})

    def check_running(self) -> None:
        for component in (self.holder, self.forwarder, self.containerd, self.kubelet):
            if component is not None and not component.running():
                raise self._failure(component, f"exited with code {component.exit_code()}")

    def container_log(self, namespace_: str, pod: str, container: str) -> str:
        """The newest log file of a container, as the kubelet wrote it (CRI log format)."""
        found = sorted(
            self.layout.pod_logs.glob(f"{namespace_}_{pod}_*/{container}/*.log"),
            key=lambda p: p.stat().st_mtime,
        )
        return found[-1].read_text(errors="replace") if found else ""

    def plugin_registered(self, driver: str) -> bool:
        """The running kubelet has registered a DRA plugin named ``driver``."""
        kubelet = self.kubelet
        if kubelet is None:
            return False
        try:
            text = kubelet.log_path.read_text(errors="replace")
        except OSError:
            return False
        # The DRA plugin manager logs each connect and disconnect per endpoint (socket); in a
        # rolling update the old plugin's endpoint disconnects after the new one connected,
        # so the last line of each endpoint counts, and any endpoint connected will do.
        last: dict[str, bool] = {}
        for line in text.splitlines():
            if "Connection changed" in line and f'driverName="{driver}"' in line:
                found = re.search(r'endpoint="([^"]*)"', line)
                last[found.group(1) if found else ""] = "connected=true" in line
        return any(last.values())

    def log_tails(self) -> str:
        """Each component's log tail, for failure messages."""
        parts = []
        for component in (self.containerd, self.kubelet, self.daemonsets):
            if component is not None:
                parts.append(f"--- {component.name} ({component.log_path}):\n{_tail(component)}")
        return "\n".join(parts)

    def _failure(self, component: Component, what: str) -> RealNodeError:
        return RealNodeError(
            f"{component.name} {what}; log {component.log_path}, last lines:\n{_tail(component)}"
        )

    def _wait(
        self, ready: Callable[[], bool], component: Component | None, timeout_s: float, what: str
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if component is not None and not component.running():
                raise self._failure(
                    component, f"exited with code {component.exit_code()} before {what}"
                )
            if ready():
                return
            time.sleep(0.2)
        if component is None:
            raise RealNodeError(f"node {self.name}: no {what} after {timeout_s:.0f}s")
        raise self._failure(component, f"gave no {what} after {timeout_s:.0f}s")
