"""The chart's kubelet plugin reaches the NVIDIA driver through the host's driver root, needs
no RuntimeClass, and tells any NVIDIA runtime hook to inject nothing into it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.unit.test_chart import find, helm, render

__all__ = ["helm"]


def _plugin(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = find(docs, "DaemonSet", "kubelet-plugin")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_defaults_mount_the_host_driver_root_and_need_no_runtime_class(helm: Path) -> None:
    pod, container = _plugin(render(helm))
    assert "runtimeClassName" not in pod
    env = _env(container)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "NVIDIA_DRIVER_CAPABILITIES" not in env
    assert (env["FLEXGPU_DRIVER_ROOT"], env["FLEXGPU_HOST_DRIVER_ROOT"]) == ("/driver-root", "/")
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["driver-root"]["mountPath"] == "/driver-root"
    assert mounts["driver-root"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["driver-root"]["hostPath"] == {"path": "/", "type": "Directory"}


def test_a_driver_container_root_is_passed_as_the_host_path(helm: Path) -> None:
    pod, container = _plugin(render(helm, "kubeletPlugin.nvidiaDriverRoot=/run/nvidia/driver"))
    assert _env(container)["FLEXGPU_HOST_DRIVER_ROOT"] == "/run/nvidia/driver"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["driver-root"]["hostPath"]["path"] == "/run/nvidia/driver"


def test_an_empty_driver_root_leaves_the_driver_out(helm: Path) -> None:
    pod, container = _plugin(render(helm, "kubeletPlugin.nvidiaDriverRoot="))
    assert "FLEXGPU_DRIVER_ROOT" not in _env(container)
    assert "driver-root" not in {v["name"] for v in pod["volumes"]}


def test_a_host_hook_path_is_passed_to_the_plugin(helm: Path) -> None:
    _, container = _plugin(render(helm))
    assert "FLEXGPU_NVIDIA_CDI_HOOK" not in _env(container)  # the image's copy by default
    _, container = _plugin(render(helm, "kubeletPlugin.nvidiaCdiHookPath=/usr/bin/nvidia-cdi-hook"))
    assert _env(container)["FLEXGPU_NVIDIA_CDI_HOOK"] == "/usr/bin/nvidia-cdi-hook"


def test_mps_daemon_pods_get_the_namespace_and_image_of_the_release(helm: Path) -> None:
    # Off, or without a driver root (the daemon's program comes from it): inside the plugin.
    for off in ("kubeletPlugin.mpsDaemonPods=false", "kubeletPlugin.nvidiaDriverRoot="):
        _, container = _plugin(render(helm, off))
        assert "FLEXGPU_MPS_NAMESPACE" not in _env(container)
        assert _env(container)["FLEXGPU_MPS_ROOT"] == "/run/flexgpu/mps"
    _, container = _plugin(render(helm))  # on by default
    env = {e["name"]: e for e in container["env"]}
    assert (
        env["FLEXGPU_MPS_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    )
    assert env["FLEXGPU_MPS_IMAGE"]["value"] == container["image"]
