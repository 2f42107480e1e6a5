from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from flexgpu.kubelet_plugin.config import (
    DRIVER_NAME,
    ConfigError,
    PluginConfig,
    make_config,
)
from flexgpu.kubelet_plugin.config_flags import load_config


def test_defaults_and_derived_paths() -> None:
    config = load_config(["--node-name", "gpu-node-1"], environ={})
    assert config.driver_name == DRIVER_NAME == "gpu.flexgpu.dev"
    assert config.registry_dir == Path("/var/lib/kubelet/plugins_registry")
    assert config.plugins_dir == Path("/var/lib/kubelet/plugins")
    assert config.cdi_dir == Path("/var/run/cdi")
    assert config.data_dir == Path("/var/lib/kubelet/plugins/gpu.flexgpu.dev")
    assert config.pod_uid is None
    assert config.registration_socket == Path(
        "/var/lib/kubelet/plugins_registry/gpu.flexgpu.dev-reg.sock"
    )
    assert config.dra_socket == Path("/var/lib/kubelet/plugins/gpu.flexgpu.dev/dra.sock")
    assert config.checkpoint_path == config.data_dir / "checkpoint.json"
    assert config.lock_path == config.data_dir / "prepare.lock"


def test_pod_uid_gives_per_instance_sockets() -> None:
    uid = "0b7f2c4e-94b5-4b8e-9a0e-5d2f7c1a3e6b"
    config = load_config(["--node-name", "n1", "--pod-uid", uid], environ={})
    assert config.registration_socket.name == f"gpu.flexgpu.dev-{uid}-reg.sock"
    assert config.dra_socket.name == f"dra-{uid}.sock"


def test_flags_win_over_env_and_env_over_defaults() -> None:
    env = {
        "FLEXGPU_NODE_NAME": "from-env",
        "FLEXGPU_CDI_DIR": "/etc/cdi",
        "FLEXGPU_HEALTH_INTERVAL": "5",
        "FLEXGPU_POD_UID": "",  # an unset downward API value arrives as empty
        "FLEXGPU_KUBE_API_QPS": "20",
        "FLEXGPU_KUBE_API_BURST": "40",
    }
    config = load_config(["--node-name", "from-flag", "--kube-api-burst", "30"], environ=env)
    assert config.node_name == "from-flag"
    assert config.cdi_dir == Path("/etc/cdi")
    assert config.health_interval_seconds == 5.0
    assert config.pod_uid is None
    assert (config.kube_api_qps, config.kube_api_burst) == (20.0, 30)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "node_name: is required"),
        (["--node-name", "Node_1"], "node_name: value 'Node_1' is not allowed: must be a DNS"),
        (["--registry-dir", "relative/dir"], "registry_dir: value 'relative/dir'"),
        (["--health-interval", "30"], "health_interval_seconds: value 30.0"),
        (["--health-interval", "0"], "greater than 0"),
        (["--health-interval", "soon"], "value 'soon' is not a number"),
        (["--pod-uid", "a/b"], "pod_uid: value 'a/b' is not allowed"),
        (["--kube-api-qps", "0"], "kube_api_qps: value 0.0"),
        (["--kube-api-qps", "fast"], "kube_api_qps (--kube-api-qps): value 'fast' is not a number"),
        (["--kube-api-burst", "2.5"], "value '2.5' is not a whole number; allowed: 1 to 10000"),
        (["--kube-api-burst", "0"], "kube_api_burst: value 0"),
        (["--plugins-dir", "/" + "p" * 90], "plugins_dir/pod_uid: socket path"),
        (
            ["--shared-gpu-tenants", "all"],
            "shared_gpu_tenants: value 'all' is not allowed: must be 'namespace' or 'any'",
        ),
        (["--pod-name", "Plugin_1"], "pod_name: value 'Plugin_1' is not allowed: must be a pod"),
    ],
)
def test_bad_values_name_field_value_and_rule(argv: list[str], expected: str) -> None:
    if "--node-name" not in argv and argv:
        argv = ["--node-name", "n1", *argv]
    with pytest.raises(ConfigError) as info:
        load_config(argv, environ={})
    assert expected in str(info.value)


def test_driver_name_is_fixed() -> None:
    with pytest.raises(ConfigError, match=r"driver_name: value 'other\.dev'.*'gpu\.flexgpu\.dev'"):
        make_config(node_name="n1", driver_name="other.dev")


def test_model_is_strict_and_frozen() -> None:
    with pytest.raises(ValidationError):
        PluginConfig(node_name="n1", registry_dir="/as/string")  # type: ignore[arg-type]
    config = make_config(node_name="n1")
    with pytest.raises(ValidationError):
        config.node_name = "other"  # type: ignore[misc]
