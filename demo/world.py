"""The demo's world on a running control plane: the Helm chart installed, the controller and
three simulated GPU nodes (kubelet plugin + kubelet harness each) running as local processes
with the chart's ServiceAccounts, and, where this machine allows it, one real node
(demo/real_node.py) whose plugin is the chart's DaemonSet pod."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from demo import real_node, usage
from demo.catalog import Seen, env_of
from flexgpu.driver.device_metadata import CONTAINER_DIR as METADATA_ROOT
from tools.cluster import create_simulated_node
from tools.cluster.binaries import REPO_ROOT, helm_tools_dir
from tools.cluster.control_plane import ControlPlane, free_port
from tools.cluster.gpu_node import SimulatedGpuNode
from tools.cluster.process import Component
from tools.cluster.tokens import service_account_kubeconfig
from tools.node import chart
from tools.node.node import RealNode

SYSTEM_NAMESPACE = "flexgpu-system"
RELEASE = "flexgpu"
# GPU node pools usually carry this taint (GKE and EKS put it on GPU nodes) so that only pods
# that ask for it land there; the catalog's pods get its toleration from the controller's pod
# toleration webhook (the chart's webhook.gpuTolerations), not from their manifests.
GPU_POOL_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
# The chart's name for it (RBAC lets the controller write no other).
WEBHOOK_CONFIGURATION = "flexgpu-validation"
TENANCY_CONFIGURATION = "flexgpu-tenancy"  # the chart's, with sharedGpuTenants: namespace
TOLERATION_CONFIGURATION = "flexgpu-gpu-tolerations"  # the chart's, with webhook.gpuTolerations
# A claim admission must refuse: the demo waits until it is refused before it goes on.
PROBE_CLAIM: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "flexgpu-admission-probe"},
    "spec": {
        "devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.flexgpu.dev"}}],
            "config": [
                {
                    "opaque": {
                        "driver": "gpu.flexgpu.dev",
                        "parameters": {
                            "apiVersion": "gpu.flexgpu.dev/v1alpha1",
                            "kind": "GpuConfig",
                            "sharing": {"strategy": "NotAStrategy"},
                        },
                    }
                }
            ],
        }
    },
}
# (node, topology, plugin flags): on-demand MIG on half the H100s, whole A100s, shared L4s.
NODES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("gpu-node-h100", "hgx-h100-8", ("--dynamic-mig-gpus=0,1,2,3",)),
    ("gpu-node-a100", "dgx-a100-8", ()),
    ("gpu-node-l4", "l4-2-pcie", ("--shared-gpus=all",)),
)


def mig_off_topology(name: str, folder: Path) -> Path:
    """The built-in topology ``name`` with MIG mode off on every GPU, as these machines ship:
    a GPU already in MIG mode publishes only the MIG devices it has (none here), never itself
    whole, and the demo's whole-GPU workloads want the whole machine (its H100s' on-demand MIG
    comes from the plugin's flag). Written as ``<folder>/<name>.yaml``, so its label stays."""
    topology = yaml.safe_load(
        (resources.files("flexgpu.driver") / "topologies" / f"{name}.yaml").read_text()
    )
    for gpu in topology["gpus"]:
        gpu.pop("migEnabled", None)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(topology, sort_keys=False))
    return path


class DemoWorld:
    def __init__(
        self,
        kubeconfig: Path,
        workdir: Path,
        *,
        pending_delay_s: float = 3,
        node_root: Path = Path("/tmp/flexgpu-demo"),
        cluster: ControlPlane | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.pending_delay_s = pending_delay_s
        self.node_root = node_root
        self.api: Any = config.new_client_from_config(config_file=str(kubeconfig))
        self.nodes: dict[str, SimulatedGpuNode] = {}
        self.controller: Component | None = None
        # node -> 127.0.0.1:<port> of its plugin's /metrics (read by `flexgpu usage`).
        self.metrics: dict[str, str] = {}
        # Without a ControlPlane object there is no real node (it joins with a certificate
        # from the control plane's PKI).
        self.cluster = cluster
        self.real: RealNode | None = None
        self.real_skipped = "no control plane handle" if cluster is None else ""

    def install_chart(self, extra: list[str] | None = None) -> None:
        tools = helm_tools_dir()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        result = subprocess.run(
            [
                str(tools / "helm"),
                "upgrade",
                "--install",
                RELEASE,
                str(REPO_ROOT / "charts" / "flexgpu"),
                "--namespace",
                SYSTEM_NAMESPACE,
                "--create-namespace",
                "--take-ownership",
                "--wait=false",
                *(extra or []),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"helm install failed: {result.stderr.strip()}")

    def start(self) -> None:
        self.install_chart(self._real_node_values())
        self.workdir.mkdir(parents=True, exist_ok=True)
        creds = self.workdir / "credentials"
        creds.mkdir(exist_ok=True)
        controller_config = service_account_kubeconfig(
            self.api,
            self.kubeconfig,
            SYSTEM_NAMESPACE,
            f"{RELEASE}-controller",
            creds / "controller.kubeconfig",
            seconds=86400,
        )
        webhook_port = free_port()
        self.point_webhooks_at(webhook_port)
        self.controller = Component(
            "flexgpu-controller",
            [
                sys.executable,
                "-m",
                "flexgpu.controller.main",
                f"--kubeconfig={controller_config}",
                f"--namespace={SYSTEM_NAMESPACE}",
                f"--pending-delay={self.pending_delay_s}",
                "--recheck-interval=2",
                "--metrics-port=0",
                "--liveness-port=0",
                f"--webhook-listen=127.0.0.1:{webhook_port}",
                "--webhook-url-host=127.0.0.1",
                f"--webhook-secret-namespace={SYSTEM_NAMESPACE}",
                f"--webhook-configuration-name={WEBHOOK_CONFIGURATION}",
                f"--tenant-webhook-configuration-name={TENANCY_CONFIGURATION}",
                f"--toleration-webhook-configuration-name={TOLERATION_CONFIGURATION}",
                # As in the chart: its token may change only the caBundle of the configuration.
                "--webhook-ca-bundle-only",
            ],
            self.workdir / "logs" / "controller.log",
        )
        self.controller.start()
        self.wait_for_admission()
        shutil.rmtree(self.node_root, ignore_errors=True)
        for name, topology, flags in NODES:
            create_simulated_node(
                self.api,
                name,
                labels={"flexgpu.dev/topology": topology},
                taints=[GPU_POOL_TAINT],
            )
            plugin_config = service_account_kubeconfig(
                self.api,
                self.kubeconfig,
                SYSTEM_NAMESPACE,
                f"{RELEASE}-kubelet-plugin",
                creds / f"{name}.kubeconfig",
                node=name,
                seconds=86400,
            )
            root = self.node_root / name
            root.mkdir(parents=True)
            port = free_port()
            node = SimulatedGpuNode(
                self.kubeconfig,
                name,
                str(mig_off_topology(topology, self.workdir / "topologies")),
                root=root,
                plugin_args=flags,
                plugin_kubeconfig=plugin_config,
                plugin_env=usage.plugin_env(root, port),
            )
            node.start()
            self.nodes[name] = node
            self.metrics[name] = f"127.0.0.1:{port}"
        self._start_real_node()
        real_node.write_state(self.workdir, node=self.real, reason=self.real_skipped)
        # The `make demo` process is not this one: it reads the endpoints from here.
        endpoints_file(self.workdir).write_text("".join(f"{e}\n" for e in self.metrics.values()))

    def _real_node_values(self) -> list[str]:
        """The chart's values for the real node's plugin pod; none when it cannot start."""
        if self.cluster is None:
            return []
        self.real_skipped = real_node.missing(self.cluster)
        if self.real_skipped:
            return []
        self.real = RealNode(
            self.cluster,
            real_node.NAME,
            gpus=real_node.GPUS,
            labels={"flexgpu.dev/topology": real_node.TOPOLOGY},
        )
        try:
            # The chart's values name the image pushed to the node's registry.
            self.real.prepare_images()
        except Exception as error:  # any build failure: the demo goes on without the node
            self._give_up_real_node(f"its images could not be built ({error})")
            return []
        return real_node.chart_values(self.real, self.real.flexgpu_image)

    def _start_real_node(self) -> None:
        node = self.real
        if node is None:
            return
        try:
            node.start()
            real_node.taint(node)
            chart.wait_plugin_serving(
                node, SYSTEM_NAMESPACE, image=node.flexgpu_image, timeout_s=240
            )
        except Exception as error:  # any failure: the demo goes on without the node
            self._give_up_real_node(f"it did not start ({error})")

    def _give_up_real_node(self, reason: str) -> None:
        print(f"real node {real_node.NAME}: {reason}", file=sys.stderr, flush=True)
        self.real_skipped = reason.splitlines()[0]
        if self.real is not None:
            self.real.cleanup()
        self.real = None

    def wait_for_admission(self, timeout_s: float = 120.0) -> None:
        """Until the apiserver refuses a bad claim (a dry run): the controller is serving the
        webhook, the configuration names where it listens, and the apiserver has loaded it.
        Claims are sent with failurePolicy Ignore, so before that they would be let through
        unchecked."""
        resource: Any = client.ResourceV1Api(self.api)
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.controller is not None and not self.controller.running():
                raise RuntimeError(f"the controller exited:\n{self.controller.log_tail()}")
            try:
                resource.create_namespaced_resource_claim("default", PROBE_CLAIM, dry_run="All")
                last = "a bad claim was admitted"
            except client.ApiException as error:
                if error.status == 422 and "denied the request" in str(error.body):
                    if self._tolerations_served():
                        return
                    last = "the pod toleration webhook has no caBundle yet"
                else:
                    last = f"{error.status}: {error.body}"
            time.sleep(0.2)
        tail = self.controller.log_tail() if self.controller is not None else ""
        raise RuntimeError(
            f"admission webhook not effective after {timeout_s:.0f}s ({last})\n{tail}"
        )

    def _tolerations_served(self) -> bool:
        """The controller filled in the pod toleration webhook's caBundle (it does so right
        after the validating one's): the catalog's pods get their toleration."""
        admission: Any = client.AdmissionregistrationV1Api(self.api)
        config = admission.read_mutating_webhook_configuration(TOLERATION_CONFIGURATION)
        return all(hook.client_config.ca_bundle for hook in config.webhooks or [])

    def point_webhooks_at(self, port: int) -> None:
        """The controller runs as a local process, not behind the chart's Service: as the
        cluster's admin, point the chart's webhooks at its local port (same paths), which the
        controller's token itself may not do."""
        admission: Any = client.AdmissionregistrationV1Api(self.api)
        for kind, name in (
            ("validating", WEBHOOK_CONFIGURATION),
            ("mutating", TENANCY_CONFIGURATION),
            ("mutating", TOLERATION_CONFIGURATION),
        ):
            config = getattr(admission, f"read_{kind}_webhook_configuration")(name)
            patch = []
            for i, hook in enumerate(config.webhooks or []):
                path = hook.client_config.service.path if hook.client_config.service else ""
                patch += [
                    {"op": "remove", "path": f"/webhooks/{i}/clientConfig/service"},
                    {
                        "op": "add",
                        "path": f"/webhooks/{i}/clientConfig/url",
                        "value": f"https://127.0.0.1:{port}{path}",
                    },
                ]
            getattr(admission, f"patch_{kind}_webhook_configuration")(name, patch)

    def stop(self) -> None:
        if self.real is not None:
            self.real.cleanup()
        for node in self.nodes.values():
            node.cleanup()
        if self.controller is not None:
            self.controller.stop()
        admission = client.AdmissionregistrationV1Api(self.api)
        with contextlib.suppress(client.ApiException):  # already gone
            admission.delete_validating_webhook_configuration(WEBHOOK_CONFIGURATION)
        with contextlib.suppress(client.ApiException):
            admission.delete_mutating_webhook_configuration(TENANCY_CONFIGURATION)
        with contextlib.suppress(client.ApiException):
            admission.delete_mutating_webhook_configuration(TOLERATION_CONFIGURATION)


def endpoints_file(workdir: Path) -> Path:
    return workdir / "plugin-metrics"


def plugin_endpoints(workdir: Path) -> list[str]:
    path = endpoints_file(workdir)
    return path.read_text().split() if path.exists() else []


def container_seen(node_root: Path, node: str, namespace: str, pod: str) -> Seen:
    """What a simulated node's container got: the environment it printed, and the device
    nodes and mounts of the OCI spec the kubelet harness built for it (with the CDI edits
    applied), which is what a runtime would have created inside."""
    folder = node_root / node / "kubelet" / "pods" / f"{namespace}_{pod}"
    log = folder / "main.log"
    seen = Seen(env=env_of(log.read_text()) if log.exists() else {})
    spec_path = folder / "main.oci.json"
    if spec_path.exists():
        try:
            spec = json.loads(spec_path.read_text())
        except ValueError:  # being written
            return seen
        seen.device_nodes = [d["path"] for d in (spec.get("linux") or {}).get("devices") or []]
        # A simulated node has no driver root: what its plugin mounts is MPS's, and the
        # device metadata files.
        for mount in spec.get("mounts") or []:
            where = str(mount["destination"])
            kind = seen.metadata if where.startswith(METADATA_ROOT) else seen.mounts
            kind.append(where)
    return seen
