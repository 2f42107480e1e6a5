"""Kubelet plugin configuration: validated settings from command-line flags and FLEXGPU_* env vars.

Precedence is flag, then environment variable, then default. Every rejection names the
setting, the offending value and what is allowed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from flexgpu.driver.quantity import parse_quantity
from flexgpu.kubelet_plugin.api.api_limits import DEFAULT_BURST, DEFAULT_QPS
from flexgpu.kubelet_plugin.kubeletplugin import MAX_SOCKET_PATH_BYTES, Options

DRIVER_NAME: Final = "gpu.flexgpu.dev"
DEFAULT_REGISTRY_DIR: Final = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR: Final = Path("/var/lib/kubelet/plugins")
DEFAULT_CDI_DIR: Final = Path("/var/run/cdi")
DEFAULT_DATA_DIR: Final = DEFAULT_PLUGINS_DIR / DRIVER_NAME
DEFAULT_HEALTH_INTERVAL_SECONDS: Final = 10.0
# The kubelet marks a device Unknown when it has had no report for 30 s (its default
# per-device timeout), so the full list must be re-sent more often than that.
MAX_HEALTH_INTERVAL_SECONDS: Final = 30.0
MAX_KUBE_API_QPS: Final = 10_000.0
MAX_KUBE_API_BURST: Final = 10_000

CHECKPOINT_FILE: Final = "checkpoint.json"
LOCK_FILE: Final = "prepare.lock"

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_POD_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")


class ConfigError(ValueError):
    """A setting was missing or had a value outside what is allowed."""


class MpsResources(BaseModel):
    """An MPS daemon pod's container resources: resource name -> quantity, as a pod says it."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)

    @field_validator("requests", "limits")
    @classmethod
    def _check_quantities(cls, value: dict[str, str]) -> dict[str, str]:
        for name, quantity in value.items():
            try:
                parse_quantity(quantity)
            except ValueError:
                raise ValueError(
                    f"{name}: {quantity!r} is not a Kubernetes quantity (such as 10m, 32Mi, 1)"
                ) from None
        return value

    def as_pod_resources(self) -> dict[str, dict[str, str]]:
        return {k: dict(v) for k, v in (("requests", self.requests), ("limits", self.limits)) if v}


class PluginConfig(BaseModel):
    """Settings of one kubelet plugin process. Immutable once built."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    node_name: str = Field(description="Kubernetes node this plugin runs on (its pool name).")
    driver_name: Literal["gpu.flexgpu.dev"] = DRIVER_NAME
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    cdi_dir: Path = DEFAULT_CDI_DIR
    data_dir: Path = DEFAULT_DATA_DIR
    pod_uid: str | None = None
    # The plugin's own pod (the chart's downward API): its DaemonSet owns the MPS daemon pods.
    pod_name: str | None = None
    health_interval_seconds: float = Field(
        default=DEFAULT_HEALTH_INTERVAL_SECONDS, gt=0, lt=MAX_HEALTH_INTERVAL_SECONDS
    )
    # /livez and /readyz for the kubelet's probes (observe/health_endpoint.py); None: off.
    health_port: int | None = Field(default=None, ge=0, le=65535)
    gpu_backend: Literal["nvml", "simulated"] = "nvml"
    # Built-in topology name or a topology file; required by (and only used with) simulated.
    topology: str | None = None
    # None: in-cluster credentials (the pod's ServiceAccount).
    kubeconfig: Path | None = None
    # GPUs published as fractions (consumable capacity): "all" or GPU indices "0,2,3".
    shared_gpus: str | None = None
    # GPUs whose MIG partitions are created on demand: "all" or GPU indices.
    dynamic_mig_gpus: str | None = None
    # The NVIDIA driver's root as this process sees it (the chart mounts the host's there);
    # None: specs get device nodes only, no driver libraries (simulated nodes).
    driver_root: Path | None = None
    # The same folder as the container runtime on the host sees it (default: driver_root).
    host_driver_root: Path | None = None
    # Prints the driver's common CDI edits (hooks/); a name is looked up in PATH.
    cdi_generator: str = "flexgpu-cdi-common"
    # Host path of nvidia-cdi-hook; None: the image's copy is installed into the data dir.
    nvidia_cdi_hook: Path | None = None
    # Namespace for MPS control daemon pods (mps_pods.py); None: the GPU backend runs them.
    mps_namespace: str | None = None
    # Image of those pods (the chart passes its own).
    mps_image: str | None = None
    # Their priority class and container resources (the chart's kubeletPlugin.mpsDaemon; its
    # admission policy admits exactly these).
    mps_priority_class: str = Field(default="system-node-critical", min_length=1)
    mps_resources: MpsResources | None = None
    # Host folder for MPS pipes, logs and shared memory, at the same path in this container.
    mps_root: Path = Path("/run/flexgpu/mps")
    # Who may share a GPU (tenancy.py): "namespace", one namespace at a time; "any": the
    # administrator lets namespaces share GPUs (docs/security.md says what that permits).
    shared_gpu_tenants: Literal["namespace", "any"] = "namespace"
    # The API client's rate limit (client-go's --kube-api-qps and --kube-api-burst).
    kube_api_qps: float = Field(default=DEFAULT_QPS, gt=0, le=MAX_KUBE_API_QPS)
    kube_api_burst: int = Field(default=DEFAULT_BURST, ge=1, le=MAX_KUBE_API_BURST)
    # Faults as device taints: auto (Kubernetes 1.36+, where they are on by default), on
    # (1.35 with DRADeviceTaints on) or off (faulty GPUs are withdrawn from the slices).
    health_taints: Literal["auto", "on", "off"] = "auto"
    # A fault's taint goes once nothing of its kind has been seen for this long.
    health_recovery_seconds: float = Field(default=300.0, ge=0)
    # On-demand MIG partitions created before the pod is bound (binding conditions): auto
    # (Kubernetes 1.36+ and the server keeps the fields), on, or off (created in prepare).
    binding_conditions: Literal["auto", "on", "off"] = "auto"
    # After creating a partition failed, the GPU's partitions stay tainted this long.
    partition_failure_seconds: float = Field(default=300.0, ge=0)
    # "<namespace>/<name>" of the controller's Lease, which says whether allocated claims
    # carry their node's label (driver/claim_node_label.py); "" watches every claim.
    claim_labels_lease: str = ""
    # on: wait, publishing nothing, while a device plugin serves the node (its resources in
    # the Node's allocatable; api/device_plugin_guard.py), reading the Node this often.
    device_plugin_guard: Literal["on", "off"] = "on"
    device_plugin_recheck_seconds: float = Field(default=30.0, gt=0, le=3600)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "text"

    @field_validator("claim_labels_lease")
    @classmethod
    def _check_claim_labels_lease(cls, value: str) -> str:
        namespace, _, name = value.partition("/")
        if value and not (
            _DNS_SUBDOMAIN.match(namespace) and _DNS_SUBDOMAIN.match(name) and "/" not in name
        ):
            raise ValueError(
                "must be empty or <namespace>/<name> of the controller's Lease, both made of "
                "lowercase letters, digits, '-' and '.'"
            )
        return value

    @field_validator("node_name")
    @classmethod
    def _check_node_name(cls, value: str) -> str:
        if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
            raise ValueError(
                "must be a DNS subdomain: at most 253 lowercase letters, digits, '-' and '.', "
                "starting and ending with a letter or digit"
            )
        return value

    @field_validator(
        "registry_dir",
        "plugins_dir",
        "cdi_dir",
        "data_dir",
        "driver_root",
        "host_driver_root",
        "nvidia_cdi_hook",
        "mps_root",
    )
    @classmethod
    def _check_dir(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        if not value.is_absolute():
            raise ValueError("must be an absolute path")
        if "\x00" in str(value):
            raise ValueError("must not contain NUL characters")
        return value

    @field_validator("pod_name")
    @classmethod
    def _check_pod_name(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 253 or not _DNS_SUBDOMAIN.match(value)):
            raise ValueError("must be a pod name (a DNS subdomain)")
        return value

    @field_validator("pod_uid")
    @classmethod
    def _check_pod_uid(cls, value: str | None) -> str | None:
        if value is not None and not _POD_UID.match(value):
            raise ValueError(
                "must be a pod UID: 1-64 letters, digits and '-', starting with a letter or digit"
            )
        return value

    @field_validator("shared_gpus", "dynamic_mig_gpus")
    @classmethod
    def _check_gpu_list(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"all|\d+(,\d+)*", value.replace(" ", "")):
            raise ValueError('must be "all" or comma-separated GPU indices such as "0,2"')
        return None if value is None else value.replace(" ", "")

    def shared_gpu_indices(self, gpu_count: int) -> frozenset[int]:
        return _indices(self.shared_gpus, gpu_count)

    def dynamic_mig_gpu_indices(self, gpu_count: int) -> frozenset[int]:
        return _indices(self.dynamic_mig_gpus, gpu_count)

    @model_validator(mode="after")
    def _check_modes_disjoint(self) -> PluginConfig:
        shared, dynamic = self.shared_gpu_indices(1 << 16), self.dynamic_mig_gpu_indices(1 << 16)
        if shared & dynamic:
            both = ",".join(str(i) for i in sorted(shared & dynamic)[:8])
            raise ValueError(
                f"shared_gpus and dynamic_mig_gpus both name GPU(s) {both}; a GPU is either "
                "shared or partitioned"
            )
        return self

    @model_validator(mode="after")
    def _check_driver_root(self) -> PluginConfig:
        if self.host_driver_root is not None and self.driver_root is None:
            raise ValueError(
                "host_driver_root is set without driver_root: set driver_root to where this "
                "process sees the driver (the chart mounts it at /driver-root)"
            )
        return self

    @model_validator(mode="after")
    def _check_mps_pods(self) -> PluginConfig:
        if self.mps_namespace is not None and (self.driver_root is None or not self.mps_image):
            raise ValueError(
                "mps_namespace needs driver_root (the MPS programs come from the driver) and "
                "mps_image (the daemon pods' image)"
            )
        if self.mps_namespace is not None and not _DNS_LABEL.match(self.mps_namespace):
            raise ValueError("mps_namespace must be a namespace name (a DNS label)")
        return self

    @model_validator(mode="after")
    def _check_backend(self) -> PluginConfig:
        if self.gpu_backend == "simulated" and not self.topology:
            raise ValueError(
                "gpu_backend: 'simulated' needs topology: a built-in name (hgx-h100-8, "
                "dgx-a100-8, h200-4, l4-2-pcie, mixed) or a topology file"
            )
        return self

    @model_validator(mode="after")
    def _check_socket_paths(self) -> PluginConfig:
        sockets = (
            ("registry_dir", self.registration_socket),
            ("plugins_dir/pod_uid", self.dra_socket),
        )
        for fields, path in sockets:
            size = len(os.fsencode(path))
            if size > MAX_SOCKET_PATH_BYTES:
                raise ValueError(
                    f"{fields}: socket path {str(path)!r} is {size} bytes; unix socket paths "
                    f"allow at most {MAX_SOCKET_PATH_BYTES}, so {fields} must be shorter"
                )
        return self

    @property
    def plugin_dir(self) -> Path:
        """Directory of the DRA socket, as the kubelet expects it for this driver."""
        return self.plugins_dir / self.driver_name

    def server_options(self) -> Options:
        """How kubeletplugin serves this plugin (sockets, health stream interval)."""
        return Options(
            driver_name=self.driver_name,
            plugin_data_dir=self.plugin_dir,
            registrar_dir=self.registry_dir,
            pod_uid=self.pod_uid,
            health_interval_seconds=self.health_interval_seconds,
        )

    @property
    def dra_socket(self) -> Path:
        return self.server_options().dra_socket

    @property
    def registration_socket(self) -> Path:
        return self.server_options().registration_socket

    @property
    def checkpoint_path(self) -> Path:
        return self.data_dir / CHECKPOINT_FILE

    @property
    def lock_path(self) -> Path:
        return self.data_dir / LOCK_FILE


def _indices(spec: str | None, gpu_count: int) -> frozenset[int]:
    if not spec:
        return frozenset()
    if spec == "all":
        return frozenset(range(gpu_count))
    return frozenset(int(i) for i in spec.split(","))


def make_config(**values: Any) -> PluginConfig:
    """PluginConfig(**values), with validation errors turned into one readable ConfigError."""
    try:
        return PluginConfig(**values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, values)) from None


def _describe(exc: ValidationError, values: Mapping[str, Any]) -> str:
    problems = []
    for error in exc.errors():
        if not error["loc"]:  # a check across fields; its message names them
            problems.append(_allowed(error))
            continue
        field = ".".join(str(part) for part in error["loc"])
        if error["type"] == "missing":
            problems.append(f"{field}: is required")
            continue
        value = values.get(field, error.get("input"))
        shown = str(value) if isinstance(value, Path) else value
        problems.append(f"{field}: value {shown!r} is not allowed: {_allowed(error)}")
    return "invalid plugin configuration: " + "; ".join(problems)


def _allowed(error: Mapping[str, Any]) -> str:
    message = str(error["msg"])
    # Pydantic prefixes messages of our own validators with "Value error, ".
    message = message.removeprefix("Value error, ")
    if error["type"] == "literal_error":
        return f"must be {error.get('ctx', {}).get('expected', repr(DRIVER_NAME))}"
    if error["type"] == "extra_forbidden":
        return "unknown setting"
    return message
