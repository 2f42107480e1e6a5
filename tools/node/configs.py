"""The real node's configuration files: containerd's, the CNI network's and the kubelet's.
Pure rendering; tools/node/node.py writes them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Pods get addresses from this range on a bridge inside the node's own network namespace.
POD_SUBNET = "10.88.0.0/24"
BRIDGE = "fgbr0"
# The cluster IP of the `kubernetes` Service; the node's namespace carries it on its loopback
# device and forwards it to the API server, so pods reach the API as in any cluster.
API_SERVICE_IP = "10.0.0.1"
API_SERVICE_PORT = 443


@dataclass(frozen=True)
class NodeLayout:
    """Every path of one real node, under one short root (Unix sockets cap paths at 107
    bytes)."""

    root: Path

    @property
    def containerd_root(self) -> Path:
        return self.root / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.root / "run"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "run" / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.root / "etc" / "containerd.toml"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "etc" / "cni"

    @property
    def cni_state(self) -> Path:
        return self.root / "cni-state"

    @property
    def registry_hosts_dir(self) -> Path:
        """containerd's per-registry host settings (hosts.toml in a folder per host)."""
        return self.root / "etc" / "certs.d"

    @property
    def registry_root(self) -> Path:
        return self.root / "registry"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "etc" / "kubelet.yaml"

    @property
    def kubelet_kubeconfig(self) -> Path:
        return self.root / "etc" / "kubelet.kubeconfig"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    @property
    def driver_root(self) -> Path:
        return self.root / "driver"

    @property
    def mps_root(self) -> Path:
        return self.root / "mps"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def registry_hosts_toml(address: str) -> str:
    """containerd's hosts.toml for a registry served over plain HTTP at ``address``."""
    return f"""server = "http://{address}"

[host."http://{address}"]
  capabilities = ["pull", "resolve"]
"""


def containerd_config(layout: NodeLayout, bin_dir: Path, sandbox_image: str) -> str:
    """containerd 2.x (config version 3): CRI with CDI, our runc, our CNI, everything under
    the node's root and nothing shared with another containerd on this machine."""
    root = layout.root
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""version = 3
root = '{layout.containerd_root}'
state = '{layout.containerd_state}'
# Plugins that would write outside the node's root or are not used here.
disabled_plugins = [
  'io.containerd.internal.v1.opt',
  'io.containerd.nri.v1.nri',
  'io.containerd.image-verifier.v1.bindir',
  'io.containerd.tracing.processor.v1.otlp',
  'io.containerd.internal.v1.tracing',
]
imports = []

[grpc]
  address = '{layout.containerd_socket}'

[ttrpc]
  address = '{layout.containerd_socket}.ttrpc'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'

[plugins.'io.containerd.cri.v1.images'.registry]
  # The local registry the flexgpu image is pulled from (plain HTTP on loopback).
  config_path = '{layout.registry_hosts_dir}'

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  # Imported from an archive; containerd would otherwise try to pull it.
  sandbox = '{sandbox_image}'

[{runtime}]
  # Lowering a process's oom_score_adj is not permitted on these machines.
  restrict_oom_score_adj = true
  cdi_spec_dirs = ['{layout.cdi_dir}']
  netns_mounts_under_state_dir = true

[{runtime}.containerd]
  default_runtime_name = 'runc'

[{runtime}.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'

[{runtime}.containerd.runtimes.runc.options]
  BinaryName = '{bin_dir / "runc"}'
  SystemdCgroup = false

[{runtime}.cni]
  bin_dirs = ['{bin_dir / "cni"}']
  conf_dir = '{layout.cni_conf_dir}'

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'

[plugins.'io.containerd.snapshotter.v1.overlayfs']
  root_path = '{root / "containerd" / "overlayfs"}'
"""


def cni_config(layout: NodeLayout) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "flexgpu-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(layout.cni_state),
                },
            },
            {"type": "loopback"},
        ],
    }


def cni_config_text(layout: NodeLayout) -> str:
    return json.dumps(cni_config(layout), indent=2) + "\n"


def kubelet_config(
    layout: NodeLayout, ca_file: Path, cgroup_root: str, feature_gates: dict[str, bool]
) -> str:
    doc: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # Ports are the usual ones: the node has a network namespace of its own.
        "address": "127.0.0.1",
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        # These machines run cgroup v1; the kubelet refuses it unless told otherwise.
        "failCgroupV1": False,
        "cgroupRoot": cgroup_root,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "podLogsDir": str(layout.pod_logs),
        "featureGates": feature_gates,
        # A test machine's disk and memory are not the node's concern: never evict.
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # No iptables here, and nothing needs the kubelet's chains.
        "makeIPTablesUtilChains": False,
        "resolvConf": "",
        "maxPods": 30,
        "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "shutdownGracePeriod": "0s",
    }
    return yaml.safe_dump(doc, sort_keys=True)


def kubeconfig(server: str, ca_file: Path, cert: Path, key: Path) -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [
            {"name": "node", "user": {"client-certificate": str(cert), "client-key": str(key)}}
        ],
        "contexts": [{"name": "node", "context": {"cluster": "local", "user": "node"}}],
        "current-context": "node",
    }
    return yaml.safe_dump(doc)
