"""Local Kubernetes control plane for flexgpu's tests and demo (tooling, not product).

Starts etcd, kube-apiserver, kube-scheduler and kube-controller-manager built from the
upstream modules (see tools/k8s), on free loopback ports, and registers simulated nodes.
"""

from tools.cluster.control_plane import ControlPlane, ControlPlaneError
from tools.cluster.nodes import create_simulated_node

__all__ = ["ControlPlane", "ControlPlaneError", "create_simulated_node"]
