"""NVIDIA's kubelet plugin on the real node (tools/node), as its DaemonSet runs it: inside the
node's namespaces, with the kubelet's registry and plugin folders, the CDI folder containerd
reads and the node's driver root, beside flexgpu's chart-installed plugin.

A MIG device's CDI edits are built from what a loaded NVIDIA kernel module shows under /proc
(``/proc/driver/nvidia/capabilities/gpu<N>/mig/gi<G>/access``, the ``nvidia-caps`` major in
``/proc/devices``), read at those absolute paths. This machine has no such module, so the
plugin runs in a mount namespace of its own where those two paths show what the simulated
driver lists (the driver root's ``mig-minors``, the same minors flexgpu's CDI edits use); the
node and its other processes see nothing of it."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tools.cluster.process import Component
from tools.node import configs, namespace
from tools.node.driver_root import CAPS_MAJOR
from tools.node.node import RealNode
from tools.nvidia_twin.plugins import NVIDIA_DRIVER, NVIDIA_IMAGE

# NVIDIA's chart's DeviceClasses (deviceclass-gpu.yaml, deviceclass-mig.yaml), without the
# extended resource name, which flexgpu's opt-in classes may hold on this cluster.
DEVICE_CLASSES = {
    "gpu.nvidia.com": "device.driver == 'gpu.nvidia.com' && "
    "device.attributes['gpu.nvidia.com'].type == 'gpu'",
    "mig.nvidia.com": "device.driver == 'gpu.nvidia.com' && "
    "device.attributes['gpu.nvidia.com'].type == 'mig'",
}
# Binds /proc's two files for the plugin alone, then becomes the plugin (same pid).
_PROC_VIEW = (
    'mount --bind "$1" /proc/driver && mount --bind "$2" /proc/devices && shift 2 && exec "$@"'
)
_ACCESS = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access (\d+)$")


def in_node_kubeconfig(cluster_kubeconfig: Path, out: Path) -> Path:
    """The admin kubeconfig with the API server where the node's network namespace reaches it
    (the kubernetes Service address, forwarded to the local API server)."""
    config = yaml.safe_load(cluster_kubeconfig.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://{configs.API_SERVICE_IP}:{configs.API_SERVICE_PORT}"
    out.write_text(yaml.safe_dump(config))
    return out


def proc_view(driver_root: Path, out: Path) -> tuple[Path, Path]:
    """``/proc/driver`` and ``/proc/devices`` as a loaded driver would show them for the
    driver root's MIG capabilities: each access file of ``proc/driver/nvidia-caps/mig-minors``
    also as ``nvidia/capabilities/gpu<N>/mig/gi<G>[/ci<C>]/access`` with its minor."""
    driver = out / "proc-driver"
    shutil.rmtree(driver, ignore_errors=True)
    shutil.copytree(driver_root / "proc" / "driver", driver)
    listed = (driver / "nvidia-caps" / "mig-minors").read_text().splitlines()
    for line in listed:
        match = _ACCESS.match(line.strip())
        if match is None:
            continue
        gpu, gi, ci, minor = match.groups()
        folder = driver / "nvidia" / "capabilities" / f"gpu{gpu}" / "mig" / f"gi{gi}"
        if ci is not None:
            folder = folder / f"ci{ci}"
        folder.mkdir(parents=True, exist_ok=True)
        # As the driver writes them: world-readable (0444 = 292), not modifiable.
        (folder / "access").write_text(
            f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 0\n"
        )
    devices = out / "proc-devices"
    own = Path("/proc/devices").read_text()
    head, _, block = own.partition("\nBlock devices:")
    devices.write_text(f"{head.rstrip()}\n{CAPS_MAJOR} nvidia-caps\n\nBlock devices:{block}")
    return driver, devices


def with_proc_view(driver_root: Path, out: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` in a mount namespace of its own where /proc shows ``driver_root``'s MIG
    capabilities (``proc_view``, written under ``out``); it keeps the same pid."""
    proc_driver, proc_devices = proc_view(driver_root, out)
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        _PROC_VIEW,
        "nvidia-proc-view",
        str(proc_driver),
        str(proc_devices),
        *argv,
    ]


def start(
    node: RealNode,
    root: Path,
    *,
    binary: Path,
    cdi_hook: Path,
    machine_env: dict[str, str],
    feature_gates: str,
) -> Component:
    """Starts NVIDIA's plugin on ``node`` over the machine ``machine_env`` names; its log is
    ``root/plugin.log``."""
    root.mkdir(parents=True, exist_ok=True)
    kubelet = node.layout.kubelet_dir
    driver = node.layout.driver_root
    argv = [
        str(binary),
        f"--node-name={node.name}",
        f"--kubeconfig={in_node_kubeconfig(node.cluster.kubeconfig, root / 'kubeconfig')}",
        f"--cdi-root={node.layout.cdi_dir}",
        f"--nvidia-driver-root={driver}",
        f"--container-driver-root={driver}",
        f"--nvidia-cdi-hook-path={cdi_hook}",
        f"--image-name={NVIDIA_IMAGE}",
        f"--kubelet-registrar-directory-path={kubelet / 'plugins_registry'}",
        f"--kubelet-plugins-directory-path={kubelet / 'plugins'}",
        *([f"--feature-gates={feature_gates}"] if feature_gates else []),
        "-v=4",
    ]
    own_mounts = with_proc_view(driver, root, argv)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), **machine_env}
    component = Component(
        "nvidia-plugin", namespace.enter_argv(node.holder_pid, own_mounts), root / "plugin.log", env
    )
    component.start()
    return component


def create_device_classes(api: Any) -> None:
    resource: Any = client.ResourceV1Api(api)
    for name, expression in DEVICE_CLASSES.items():
        resource.create_device_class(
            {
                "metadata": {"name": name},
                "spec": {"selectors": [{"cel": {"expression": expression}}]},
            }
        )


def remove(api: Any, node: RealNode) -> None:
    """NVIDIA's DeviceClasses and the node's NVIDIA slices, once its plugin stopped."""
    resource: Any = client.ResourceV1Api(api)
    for name in DEVICE_CLASSES:
        try:
            resource.delete_device_class(name)
        except client.ApiException as err:
            if err.status != 404:
                raise
    resource.delete_collection_resource_slice(
        field_selector=f"spec.driver={NVIDIA_DRIVER},spec.nodeName={node.name}"
    )
