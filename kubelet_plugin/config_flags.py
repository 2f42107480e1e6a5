"""The plugin's settings as flags and FLEXGPU_* environment variables (the chart sets the
latter): one table of them, how each raw value is read, and ``load_config``, which turns flags
and environment into a validated ``PluginConfig`` (config.py)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from flexgpu.driver.durations import parse_duration
from flexgpu.kubelet_plugin.api.api_limits import DEFAULT_BURST, DEFAULT_QPS
from flexgpu.kubelet_plugin.config import (
    DEFAULT_CDI_DIR,
    DEFAULT_DATA_DIR,
    DEFAULT_HEALTH_INTERVAL_SECONDS,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRY_DIR,
    DRIVER_NAME,
    MAX_HEALTH_INTERVAL_SECONDS,
    MAX_KUBE_API_BURST,
    MAX_KUBE_API_QPS,
    ConfigError,
    PluginConfig,
    make_config,
)


@dataclass(frozen=True)
class Setting:
    field: str
    flag: str
    env: str
    help: str
    kind: Literal["str", "path", "seconds", "number", "count", "port", "json", "duration"]


SETTINGS: Final = (
    Setting("node_name", "--node-name", "FLEXGPU_NODE_NAME", "node name (required)", "str"),
    Setting(
        "registry_dir",
        "--registry-dir",
        "FLEXGPU_REGISTRY_DIR",
        f"kubelet plugin registry directory (default {DEFAULT_REGISTRY_DIR})",
        "path",
    ),
    Setting(
        "plugins_dir",
        "--plugins-dir",
        "FLEXGPU_PLUGINS_DIR",
        f"kubelet plugins directory (default {DEFAULT_PLUGINS_DIR})",
        "path",
    ),
    Setting(
        "cdi_dir",
        "--cdi-dir",
        "FLEXGPU_CDI_DIR",
        f"CDI spec directory (default {DEFAULT_CDI_DIR})",
        "path",
    ),
    Setting(
        "data_dir",
        "--data-dir",
        "FLEXGPU_DATA_DIR",
        f"checkpoint and lock directory (default {DEFAULT_DATA_DIR})",
        "path",
    ),
    Setting(
        "pod_name",
        "--pod-name",
        "FLEXGPU_POD_NAME",
        "the plugin's own pod; its DaemonSet then owns the MPS daemon pods (default: the Node)",
        "str",
    ),
    Setting(
        "pod_uid",
        "--pod-uid",
        "FLEXGPU_POD_UID",
        "UID of this plugin's pod; enables rolling updates",
        "str",
    ),
    Setting(
        "health_interval_seconds",
        "--health-interval",
        "FLEXGPU_HEALTH_INTERVAL",
        f"seconds between full health reports (default {DEFAULT_HEALTH_INTERVAL_SECONDS}, "
        f"below {MAX_HEALTH_INTERVAL_SECONDS})",
        "seconds",
    ),
    Setting(
        "health_port",
        "--health-port",
        "FLEXGPU_HEALTH_PORT",
        "port serving /livez and /readyz for the kubelet's probes (default: off)",
        "port",
    ),
    Setting(
        "gpu_backend",
        "--gpu-backend",
        "FLEXGPU_GPU_BACKEND",
        "where GPUs come from: nvml (default) or simulated",
        "str",
    ),
    Setting(
        "topology",
        "--topology",
        "FLEXGPU_TOPOLOGY",
        "simulated node topology: built-in name or YAML file",
        "str",
    ),
    Setting(
        "shared_gpus",
        "--shared-gpus",
        "FLEXGPU_SHARED_GPUS",
        'GPUs published as fractions: "all" or indices such as "0,2" (default: none)',
        "str",
    ),
    Setting(
        "dynamic_mig_gpus",
        "--dynamic-mig-gpus",
        "FLEXGPU_DYNAMIC_MIG_GPUS",
        'GPUs partitioned on demand (MIG): "all" or indices such as "4,5" (default: none)',
        "str",
    ),
    Setting(
        "driver_root",
        "--driver-root",
        "FLEXGPU_DRIVER_ROOT",
        "NVIDIA driver root as this process sees it; CDI specs then carry the driver's "
        "libraries, programs and hooks (default: none, device nodes only)",
        "path",
    ),
    Setting(
        "host_driver_root",
        "--host-driver-root",
        "FLEXGPU_HOST_DRIVER_ROOT",
        "the driver root as the host sees it (default: --driver-root)",
        "path",
    ),
    Setting(
        "cdi_generator",
        "--cdi-generator",
        "FLEXGPU_CDI_GENERATOR",
        "program printing the driver's common CDI edits (default flexgpu-cdi-common, in PATH)",
        "str",
    ),
    Setting(
        "nvidia_cdi_hook",
        "--nvidia-cdi-hook",
        "FLEXGPU_NVIDIA_CDI_HOOK",
        "host path of nvidia-cdi-hook (default: the image's copy, installed in the data dir)",
        "path",
    ),
    Setting(
        "mps_namespace",
        "--mps-namespace",
        "FLEXGPU_MPS_NAMESPACE",
        "run MPS control daemons as pods in this namespace (default: inside the plugin)",
        "str",
    ),
    Setting(
        "mps_image",
        "--mps-image",
        "FLEXGPU_MPS_IMAGE",
        "image of the MPS daemon pods",
        "str",
    ),
    Setting(
        "mps_priority_class",
        "--mps-priority-class",
        "FLEXGPU_MPS_PRIORITY_CLASS",
        "priority class of the MPS daemon pods (default system-node-critical)",
        "str",
    ),
    Setting(
        "mps_resources",
        "--mps-resources",
        "FLEXGPU_MPS_RESOURCES",
        'container resources of the MPS daemon pods, as JSON: {"requests": {...}, "limits": '
        "{...}} (default: cpu 10m and memory 32Mi requested, memory 256Mi limit)",
        "json",
    ),
    Setting(
        "mps_root",
        "--mps-root",
        "FLEXGPU_MPS_ROOT",
        "host folder for MPS pipes, logs and shared memory (default /run/flexgpu/mps)",
        "path",
    ),
    Setting(
        "shared_gpu_tenants",
        "--shared-gpu-tenants",
        "FLEXGPU_SHARED_GPU_TENANTS",
        "who may share a GPU's MPS daemon and fractions: namespace (default: the claims of "
        "one namespace at a time) or any",
        "str",
    ),
    Setting(
        "health_taints",
        "--health-taints",
        "FLEXGPU_HEALTH_TAINTS",
        "GPU faults as device taints: auto (default: Kubernetes 1.36+), on or off (withdraw)",
        "str",
    ),
    Setting(
        "health_recovery_seconds",
        "--health-recovery-period",
        "FLEXGPU_HEALTH_RECOVERY_PERIOD",
        "healthy time before a fault's taint is cleared, such as 90s or 5m (default 5m)",
        "duration",
    ),
    Setting(
        "binding_conditions",
        "--binding-conditions",
        "FLEXGPU_BINDING_CONDITIONS",
        "on-demand MIG partitions created before the pod is bound: auto (default: "
        "Kubernetes 1.36+ with the feature on), on, or off (created in prepare)",
        "str",
    ),
    Setting(
        "partition_failure_seconds",
        "--partition-failure-cooldown",
        "FLEXGPU_PARTITION_FAILURE_COOLDOWN",
        "how long a GPU's partitions stay tainted after creating one failed, such as 90s or "
        "5m (default 5m)",
        "duration",
    ),
    Setting(
        "claim_labels_lease",
        "--claim-labels-lease",
        "FLEXGPU_CLAIM_LABELS_LEASE",
        "<namespace>/<name> of the controller's Lease; while it says claims carry their "
        "node's label, binding conditions watch only this node's claims (default: every claim)",
        "str",
    ),
    Setting(
        "device_plugin_guard",
        "--device-plugin-guard",
        "FLEXGPU_DEVICE_PLUGIN_GUARD",
        "on (default): publish nothing while the Node's allocatable shows NVIDIA's device "
        "plugin (nvidia.com/gpu, nvidia.com/gpu.shared, nvidia.com/mig-*); off: never check",
        "str",
    ),
    Setting(
        "device_plugin_recheck_seconds",
        "--device-plugin-recheck",
        "FLEXGPU_DEVICE_PLUGIN_RECHECK",
        "how often the Node is read again while a device plugin serves it, such as 10s or "
        "1m (default 30s)",
        "duration",
    ),
    Setting(
        "log_level",
        "--log-level",
        "FLEXGPU_LOG_LEVEL",
        "debug, info (default), warning or error",
        "str",
    ),
    Setting(
        "log_format",
        "--log-format",
        "FLEXGPU_LOG_FORMAT",
        "json (one object per line) or text (default)",
        "str",
    ),
    Setting(
        "kube_api_qps",
        "--kube-api-qps",
        "FLEXGPU_KUBE_API_QPS",
        f"API requests per second, sustained (default {DEFAULT_QPS:g})",
        "number",
    ),
    Setting(
        "kube_api_burst",
        "--kube-api-burst",
        "FLEXGPU_KUBE_API_BURST",
        f"API requests at once above the per-second rate (default {DEFAULT_BURST})",
        "count",
    ),
    Setting(
        "kubeconfig",
        "--kubeconfig",
        "FLEXGPU_KUBECONFIG",
        "kubeconfig file (default: in-cluster ServiceAccount)",
        "path",
    ),
)


def convert(setting: Setting, raw: str, source: str) -> str | Path | float | object:
    if setting.kind == "path":
        return Path(raw)
    if setting.kind == "duration":
        try:
            return parse_duration(raw)
        except ValueError as err:
            raise ConfigError(f"{setting.field} ({source}): {err}") from None
    if setting.kind == "seconds":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(
                f"{setting.field} ({source}): value {raw!r} is not a number; "
                f"allowed: seconds greater than 0 and below {MAX_HEALTH_INTERVAL_SECONDS}"
            ) from None
    if setting.kind == "number":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(
                f"{setting.field} ({source}): value {raw!r} is not a number; "
                f"allowed: a number greater than 0, at most {MAX_KUBE_API_QPS:g}"
            ) from None
    if setting.kind == "json":
        try:
            parsed: object = json.loads(raw)
            return parsed
        except ValueError as err:
            raise ConfigError(
                f"{setting.field} ({source}): value {raw!r} is not JSON ({err}); allowed: a "
                'JSON object such as {"requests": {"memory": "32Mi"}, "limits": {"memory": '
                '"256Mi"}}'
            ) from None
    if setting.kind == "port":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(
                f"{setting.field} ({source}): value {raw!r} is not a port number; "
                "allowed: 0 (any free port) to 65535"
            ) from None
    if setting.kind == "count":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(
                f"{setting.field} ({source}): value {raw!r} is not a whole number; "
                f"allowed: 1 to {MAX_KUBE_API_BURST}"
            ) from None
    return raw


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexgpu-kubelet-plugin",
        description=f"Kubelet plugin of the {DRIVER_NAME} DRA driver.",
    )
    for setting in SETTINGS:
        parser.add_argument(
            setting.flag,
            dest=setting.field,
            default=None,
            help=f"{setting.help} [env {setting.env}]",
        )
    return parser


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> PluginConfig:
    """Build the configuration from flags (argv, without the program name) and env vars."""
    env = os.environ if environ is None else environ
    args = build_arg_parser().parse_args(list(argv) if argv is not None else [])
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        flag_value = getattr(args, setting.field)
        if flag_value is not None:
            values[setting.field] = convert(setting, flag_value, setting.flag)
        elif env.get(setting.env):  # an empty variable (e.g. unset downward API field) is unset
            values[setting.field] = convert(setting, env[setting.env], setting.env)
    return make_config(**values)
