"""The chart installed for a real node: its kubelet-plugin DaemonSet runs the locally built
flexgpu image as a real pod, with the node's kubelet, CDI and MPS folders."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from tools.cluster.binaries import REPO_ROOT, helm_tools_dir
from tools.node.node import RealNode

CHART = REPO_ROOT / "charts" / "flexgpu"
DRIVER = "gpu.flexgpu.dev"
PLUGIN_LABELS = "app.kubernetes.io/component=kubelet-plugin"
# A plugin that exits this often will not serve: say why at once instead of timing out.
CRASH_LOOP_RESTARTS = 3


class ChartError(RuntimeError):
    pass


def image_values(registry: str, image: str) -> dict[str, str]:
    """The chart's image values for ``image``: one in the node's ``registry`` (host:port) is
    pulled through image.registry, image.repository and image.digest (or image.tag), as an
    admin's cluster pulls a release; any other name was side-loaded into the node's
    containerd."""
    prefix = f"{registry}/"
    if registry and image.startswith(prefix):
        name = image[len(prefix) :]
        if "@" in name:
            repository, _, digest = name.partition("@")
            pin = {"image.digest": digest}
        else:
            repository, _, tag = name.rpartition(":")
            pin = {"image.tag": tag, "image.digest": ""}
        return {
            "image.registry": registry,
            "image.repository": repository,
            **pin,
            "image.pullPolicy": "IfNotPresent",
        }
    repository, _, tag = image.rpartition(":")
    # The name is whole (no registry in front of it) and there is nothing to pull.
    return {
        "image.registry": "",
        "image.repository": repository,
        "image.tag": tag,
        "image.pullPolicy": "Never",
    }


def plugin_values(node: RealNode, image: str, topology: str) -> list[str]:
    """``--set`` arguments pointing the chart at the node's own folders and image."""
    layout = node.layout
    values = {
        **image_values(node.image_source.address, image),
        "kubeletPlugin.gpuBackend": "simulated",
        "kubeletPlugin.topology": topology,
        "kubeletPlugin.kubeletDir": str(layout.kubelet_dir),
        "kubeletPlugin.cdiDir": str(layout.cdi_dir),
        "kubeletPlugin.mpsRoot": str(layout.mps_root),
        # containerd's default runtime injects nothing; CDI does.
        "kubeletPlugin.runtimeClassName": "",
        "kubeletPlugin.healthIntervalSeconds": "2",
        # The controller is tested on its own; here it would only crash-loop without a
        # reachable webhook Service. A selector no node matches keeps it unscheduled.
        "controller.nodeSelector.flexgpu-real-node-test": "no-node",
    }
    if "nvidiaDriverRoot:" in (CHART / "values.yaml").read_text():
        # The plugin mounts the node's driver root and runs NVIDIA's CDI generator over it.
        values["kubeletPlugin.nvidiaDriverRoot"] = str(layout.driver_root)
    args: list[str] = []
    for key, value in values.items():
        as_string = key.endswith(("tag", "topology", "digest"))
        args += ["--set-string" if as_string else "--set", f"{key}={value}"]
    return args


def helm(kubeconfig: Path, *args: str, timeout_s: float = 180) -> str:
    tools = helm_tools_dir()
    proc = subprocess.run(
        [str(tools / "helm"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise ChartError(
            f"helm {' '.join(args[:2])} failed (exit {proc.returncode}): {proc.stderr}"
        )
    return proc.stdout


def package(dest: Path) -> Path:
    """The chart as a release ships it: ``helm package`` of the chart folder."""
    dest.mkdir(parents=True, exist_ok=True)
    out = helm(Path(os.devnull), "package", str(CHART), "--destination", str(dest))
    path = Path(out.strip().rsplit(": ", 1)[-1])
    if not path.is_file():
        raise ChartError(f"helm package wrote no archive where it said: {out.strip()}")
    return path


def install(
    node: RealNode,
    *,
    release: str,
    namespace: str,
    image: str,
    topology: str,
    extra: tuple[str, ...] = (),
) -> None:
    """``helm upgrade --install`` of the packaged chart (so a second call rolls the
    DaemonSet)."""
    helm(
        node.cluster.kubeconfig,
        "upgrade",
        "--install",
        release,
        str(package(node.layout.root / "charts")),
        "--namespace",
        namespace,
        "--create-namespace",
        # DeviceClasses may already exist from other tests: adopt them.
        "--take-ownership",
        "--wait=false",
        *plugin_values(node, image, topology),
        *extra,
    )


def uninstall(node: RealNode, *, release: str, namespace: str) -> None:
    helm(node.cluster.kubeconfig, "uninstall", release, "--namespace", namespace, "--wait")


def plugin_pods(api: Any, namespace: str, node: str, labels: str = PLUGIN_LABELS) -> list[Any]:
    pods: list[Any] = (
        client.CoreV1Api(api)
        .list_namespaced_pod(
            namespace, label_selector=labels, field_selector=f"spec.nodeName={node}"
        )
        .items
    )
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def _ready(pod: Any) -> bool:
    statuses = pod.status.container_statuses or []
    return pod.status.phase == "Running" and bool(statuses) and all(s.ready for s in statuses)


def wait_plugin_serving(
    node: RealNode,
    namespace: str,
    *,
    image: str | None = None,
    timeout_s: float = 180,
    driver: str = DRIVER,
    labels: str = PLUGIN_LABELS,
) -> Any:
    """Waits until one ready plugin pod (of ``image``, when given) runs on the node, its
    slices are published and the kubelet registered it. Returns the pod. ``driver`` and
    ``labels`` (the pods' selector) name another driver's plugin (the reference driver's)."""
    api = node.api
    deadline = time.monotonic() + timeout_s
    last = "no plugin pod"
    while time.monotonic() < deadline:
        node.check_running()
        pods = [
            p
            for p in plugin_pods(api, namespace, node.name, labels)
            if _ready(p) and (image is None or p.spec.containers[0].image == image)
        ]
        if pods:
            slices = (
                client.ResourceV1Api(api)
                .list_resource_slice(
                    field_selector=f"spec.nodeName={node.name},spec.driver={driver}"
                )
                .items
            )
            registered = node.plugin_registered(driver)
            if slices and registered:
                return pods[0]
            last = (
                f"pod {pods[0].metadata.name} ready; slices={len(slices)}; "
                f"kubelet registered={registered}"
            )
        else:
            found = plugin_pods(api, namespace, node.name, labels)
            last = f"plugin pods {[f'{p.metadata.name}:{p.status.phase}' for p in found]}"
            restarts = max(
                (s.restart_count for p in found for s in p.status.container_statuses or []),
                default=0,
            )
            if restarts >= CRASH_LOOP_RESTARTS:
                last = f"the plugin container restarted {restarts} times"
                break
        time.sleep(0.5)
    logs = "\n".join(
        f"--- {name}:\n{node.container_log(namespace, name, 'plugin')[-3000:]}"
        for name in (p.metadata.name for p in plugin_pods(api, namespace, node.name, labels))
    )
    raise ChartError(
        f"{driver}'s plugin is not serving on {node.name} (waited up to {timeout_s:.0f}s: "
        f"{last})\n{logs}\n{node.log_tails()}"
    )
