"""The reference DRA driver (sigs.k8s.io/dra-example-driver) on the real node as its own project
deploys it: its upstream Helm chart, unchanged, from the Go module cache (the version whose
plugin tools/images/example_driver builds), with the chart's defaults for everything but the
image and the node's folders. Its kubelet plugin then runs as a DaemonSet pod in the node's
pod cgroup, as flexgpu's does.

The chart mounts the CDI folder from a fixed hostPath (/var/run/cdi) that no value reaches;
this node's CDI folder is elsewhere (containerd reads it from there). So the chart is
rendered with ``helm template``, that one hostPath is pointed at the node's CDI folder, and
the result is applied with kubectl. Everything else is what the chart renders."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from release.layers import BuiltImage
from tools.cluster.binaries import helm_tools_dir
from tools.images.example_driver import GO_MOD, MODULE, example_driver_image, version
from tools.node.chart import ChartError, helm, wait_plugin_serving
from tools.node.node import RealNode

DRIVER = "gpu.example.com"
RELEASE = "dra-example-driver"
NAMESPACE = "dra-example-driver"
PLUGIN_LABELS = "app.kubernetes.io/component=kubeletplugin"
CHART_CDI_PATH = "/var/run/cdi"


def chart_dir() -> Path:
    """The chart as the pinned module ships it: ``go mod download`` fetches the module (a zip
    from the module proxy, seconds) where the plugin's build has not already."""
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{MODULE}@{version()}"],
        cwd=GO_MOD.parent,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise ChartError(
            f"go mod download {MODULE}@{version()} failed (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
        )
    path = Path(json.loads(proc.stdout)["Dir"]) / "deployments" / "helm" / RELEASE
    if not (path / "Chart.yaml").is_file():
        raise ChartError(f"{MODULE}@{version()} holds no chart at {path}")
    return path


def render(node: RealNode, image: BuiltImage) -> list[dict[str, Any]]:
    """The chart's objects for the node: ``helm template`` with the image and kubelet folder
    values, the CDI hostPath replaced (see the module's docstring)."""
    repository, _, tag = image.name.rpartition(":")
    kubelet = node.layout.kubelet_dir
    values = {
        "image.repository": repository,
        "image.tag": tag,
        # Side-loaded into the node's containerd: nothing to pull.
        "image.pullPolicy": "Never",
        "kubeletPlugin.kubeletRegistrarDirectoryPath": str(kubelet / "plugins_registry"),
        "kubeletPlugin.kubeletPluginsDirectoryPath": str(kubelet / "plugins"),
    }
    args = [a for key, value in values.items() for a in ("--set-string", f"{key}={value}")]
    text = helm(
        node.cluster.kubeconfig,
        "template",
        RELEASE,
        str(chart_dir()),
        "--namespace",
        NAMESPACE,
        *args,
    )
    objects = [o for o in yaml.safe_load_all(text) if o]
    replaced = 0
    for obj in objects:
        if obj.get("kind") != "DaemonSet":
            continue
        for volume in obj["spec"]["template"]["spec"].get("volumes", []):
            host = volume.get("hostPath")
            if host is not None and host.get("path") == CHART_CDI_PATH:
                host["path"] = str(node.layout.cdi_dir)
                replaced += 1
    if replaced != 1:
        raise ChartError(
            f"expected one hostPath {CHART_CDI_PATH} in the chart's DaemonSet, found {replaced}"
        )
    return objects


def _kubectl(node: RealNode, *args: str, stdin: str) -> None:
    proc = subprocess.run(
        [str(helm_tools_dir() / "kubectl"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(node.cluster.kubeconfig)},
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise ChartError(
            f"kubectl {' '.join(args[:2])} failed (exit {proc.returncode}): {proc.stderr}"
        )


def install(node: RealNode) -> list[dict[str, Any]]:
    """Builds and side-loads the plugin's image, then applies the chart's objects in their
    namespace. Returns the objects (for ``uninstall``)."""
    image = example_driver_image()
    node.import_image(image)
    objects = render(node, image)
    core: Any = client.CoreV1Api(node.api)
    if not core.list_namespace(field_selector=f"metadata.name={NAMESPACE}").items:
        core.create_namespace({"metadata": {"name": NAMESPACE}})
    _kubectl(node, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(objects))
    return objects


def uninstall(node: RealNode, objects: list[dict[str, Any]]) -> None:
    _kubectl(
        node, "delete", "--ignore-not-found", "--wait", "-f", "-", stdin=yaml.safe_dump_all(objects)
    )


def wait_serving(node: RealNode, timeout_s: float = 180) -> Any:
    """Waits until the plugin pod is ready, its slices are published and the kubelet
    registered it. Returns the pod."""
    return wait_plugin_serving(
        node, NAMESPACE, timeout_s=timeout_s, driver=DRIVER, labels=PLUGIN_LABELS
    )
