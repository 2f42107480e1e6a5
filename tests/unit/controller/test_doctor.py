"""``flexgpu doctor``: each node check names what is wrong and what to set, on host roots laid
out as real hosts are (containerd 1.7/2.x and CRI-O configs, an old glibc, NVIDIA's device
plugin socket); the driver's version and MIG state come from NVML (the mock library, run in a
process of its own as the init container runs it); the cluster checks read gates from the API
server's metrics and catch a node two drivers serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexgpu.controller.cli_doctor import checks_table
from flexgpu.controller.doctor_cluster import gate_checks, node_checks, parse_feature_metrics
from flexgpu.driver.preflight import (
    Check,
    NodeFacts,
    Status,
    device_plugin_check,
    driver_root_check,
    hook_check,
    runtime_cdi_check,
    worst,
)
from tests.nvml_library import ENV_CONFIG, ENV_STATE, MockMachine, library_dir

REPO = Path(__file__).resolve().parents[3]


def _host(tmp_path: Path, files: dict[str, str | bytes]) -> NodeFacts:
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return NodeFacts(driver_root=tmp_path, host_root=tmp_path)


@pytest.mark.parametrize(
    ("config", "status", "says"),
    [
        ("version = 3\n", Status.OK, "reads CDI specs"),
        ("version = 2\n", Status.WARN, "containerd 1.7 leaves CDI off"),
        (
            'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nenable_cdi = true\n',
            Status.OK,
            "reads CDI specs",
        ),
        (
            'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nenable_cdi = false\n',
            Status.FAIL,
            "enable_cdi = false",
        ),
        (
            'version = 3\n[plugins."io.containerd.cri.v1.runtime"]\ncdi_spec_dirs = ["/etc/cdi"]\n',
            Status.FAIL,
            "lacks /var/run/cdi",
        ),
        ("version = [", Status.WARN, "not valid TOML"),
    ],
)
def test_containerd_cdi(tmp_path: Path, config: str, status: Status, says: str) -> None:
    check = runtime_cdi_check(_host(tmp_path, {"etc/containerd/config.toml": config}))
    assert check.status is status and says in check.detail, check


def test_crio_cdi_dirs(tmp_path: Path) -> None:
    conf = '[crio.runtime]\ncdi_spec_dirs = ["/etc/cdi"]\n'
    check = runtime_cdi_check(_host(tmp_path, {"etc/crio/crio.conf": conf}))
    assert check.status is Status.FAIL and "/var/run/cdi" in check.detail
    assert runtime_cdi_check(_host(tmp_path, {"etc/crio/crio.conf": ""})).status is Status.OK


def test_old_glibc_needs_the_toolkits_hook(tmp_path: Path) -> None:
    libc = b"\x7fELF...GLIBC_2.17\x00GLIBC_2.28\x00GLIBC_2.34\x00..."
    facts = _host(tmp_path, {"lib64/libc.so.6": libc, "usr/bin/nvidia-cdi-hook": "#!/bin/sh\n"})
    check = hook_check(facts)
    assert check.status is Status.FAIL
    assert "glibc is 2.34" in check.detail
    assert "nvidiaCdiHookPath=/usr/bin/nvidia-cdi-hook (found on the host)" in check.detail
    (tmp_path / "usr/bin/nvidia-cdi-hook").chmod(0o755)
    named = NodeFacts(tmp_path, tmp_path, hook_path="/usr/bin/nvidia-cdi-hook")
    assert hook_check(named).status is Status.OK
    missing = NodeFacts(tmp_path, tmp_path, hook_path="/opt/none/nvidia-cdi-hook")
    assert "is not an executable on the host" in hook_check(missing).detail


def test_new_glibc_runs_the_images_hook(tmp_path: Path) -> None:
    facts = _host(tmp_path, {"usr/lib/x86_64-linux-gnu/libc.so.6": b"GLIBC_2.36\x00GLIBC_2.38"})
    check = hook_check(facts)
    assert check.status is Status.OK and "2.38" in check.detail


def test_device_plugin_socket_fails_the_node(tmp_path: Path) -> None:
    facts = _host(tmp_path, {"var/lib/kubelet/device-plugins/kubelet.sock": ""})
    assert device_plugin_check(facts).status is Status.OK
    _host(tmp_path, {"var/lib/kubelet/device-plugins/nvidia-gpu.sock": ""})
    check = device_plugin_check(facts)
    assert check.status is Status.FAIL and "nvidia-gpu.sock" in check.detail


def test_driver_root_without_nvml_names_the_value(tmp_path: Path) -> None:
    check = driver_root_check(NodeFacts(tmp_path, tmp_path))
    assert check.status is Status.FAIL
    assert "kubeletPlugin.nvidiaDriverRoot" in check.detail and str(tmp_path) in check.detail


def _driver_root(tmp_path: Path, version: str) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "driver"
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libnvidia-ml.so.1").symlink_to(library_dir() / "libnvidia-ml.so.1")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/nvidia-smi").write_text("")
    machine = MockMachine.write(
        tmp_path / "nvml",
        {
            "driverVersion": version,
            "cudaDriverVersion": 13000,
            "gpus": [
                {"model": "H100-SXM5-80GB", "uuid": "GPU-0000000a-1111-4000-8000-000000000001"},
                {
                    "model": "A100-SXM4-80GB",
                    "uuid": "GPU-0000000b-1111-4000-8000-000000000002",
                    "migEnabled": True,
                },
            ],
        },
    )
    env = {**os.environ, ENV_CONFIG: str(machine.config_path), ENV_STATE: str(machine.state_path)}
    return root, env


def _doctor_node(root: Path, env: dict[str, str]) -> tuple[int, dict[str, Check]]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexgpu.controller.cli",
            "doctor",
            "node",
            "-o",
            "json",
            "--driver-root",
            str(root),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
    )
    document = json.loads(result.stdout)
    checks = {
        c["name"]: Check(c["name"], Status(c["status"]), c["detail"]) for c in document["checks"]
    }
    return result.returncode, checks


def test_nvml_reports_driver_version_and_mig_mode(tmp_path: Path) -> None:
    root, env = _driver_root(tmp_path, "580.95.05")
    code, checks = _doctor_node(root, env)
    assert checks["driver-root"].status is Status.OK
    assert checks["driver-version"] == Check(
        "driver-version", Status.OK, "driver 580.95.05, 2 GPUs"
    )
    assert (
        checks["mig-mode"].status is Status.WARN
        and "GPUs in MIG mode: 1 " in checks["mig-mode"].detail
    )
    assert code == 0


def test_too_old_driver_fails_with_exit_5(tmp_path: Path) -> None:
    root, env = _driver_root(tmp_path, "470.256.02")
    code, checks = _doctor_node(root, env)
    assert checks["driver-version"].status is Status.FAIL
    assert "older than R495" in checks["driver-version"].detail
    assert code == 5


def test_feature_gates_from_metrics() -> None:
    text = (
        "# HELP kubernetes_feature_enabled ...\n"
        'kubernetes_feature_enabled{name="DRAPartitionableDevices",stage="ALPHA"} 0\n'
        'kubernetes_feature_enabled{name="DRAConsumableCapacity",stage="ALPHA"} 1\n'
        'kubernetes_feature_enabled{name="DRADeviceTaints",stage="BETA"} 1\n'
    )
    gates = parse_feature_metrics(text)
    assert gates == {
        "DRAPartitionableDevices": False,
        "DRAConsumableCapacity": True,
        "DRADeviceTaints": True,
    }
    checks = {c.name: c for c in gate_checks(35, gates, "")}
    assert checks["gate DRAPartitionableDevices"].status is Status.WARN
    assert "on-demand MIG" in checks["gate DRAPartitionableDevices"].detail
    assert checks["gate DRAConsumableCapacity"].status is Status.OK
    assert checks["gate DRAExtendedResource"].status is Status.WARN
    unknown = gate_checks(36, None, "forbidden")
    assert {c.status for c in unknown} == {Status.SKIP}
    assert "on by default on 1.36" in unknown[0].detail


def test_node_served_by_both_drivers_fails() -> None:
    nodes = [
        {"metadata": {"name": "a"}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}},
        {"metadata": {"name": "b", "labels": {"nvidia.com/gpu.present": "true"}}},
        {"metadata": {"name": "c"}, "status": {"allocatable": {"cpu": "8"}}},
    ]
    events = [
        {
            "involvedObject": {"name": "c"},
            "reason": "FlexgpuPreflightPassed",
            "message": "OK: old",
            "lastTimestamp": "2026-01-01T00:00:00Z",
        },
        {
            "involvedObject": {"name": "c"},
            "reason": "FlexgpuPreflightFailed",
            "message": "FAIL: runtime-cdi: enable_cdi = false",
            "lastTimestamp": "2026-01-02T00:00:00Z",
        },
    ]
    checks = {c.name: c for c in node_checks(nodes, {"a", "c"}, events)}
    assert checks["node a"].status is Status.FAIL and "both serve" in checks["node a"].detail
    assert checks["node b"].status is Status.WARN
    assert checks["node c"].status is Status.OK
    assert checks["node c preflight"] == Check(
        "node c preflight", Status.FAIL, "FAIL: runtime-cdi: enable_cdi = false"
    )
    assert worst(list(checks.values())) is Status.FAIL
    assert checks_table(list(checks.values())).splitlines()[0].split() == [
        "CHECK",
        "STATUS",
        "DETAIL",
    ]


def test_static_image_hook_runs_on_any_host(tmp_path: Path) -> None:
    """The hook hooks/ builds (and the image ships) is linked statically, so the host's
    glibc does not matter; a dynamically linked one is still judged by the host's glibc."""
    from tests.nvidia_ctk import tools_dir as toolkit_dir

    hook = toolkit_dir() / "nvidia-cdi-hook"
    old_host = _host(tmp_path, {"lib64/libc.so.6": b"GLIBC_2.17\x00GLIBC_2.28"})
    static = NodeFacts(tmp_path, tmp_path, image_hook=hook)
    assert hook_check(static) == Check(
        "cdi-hook", Status.OK, "the image's hook is statically linked: any host runs it"
    )
    dynamic = NodeFacts(tmp_path, tmp_path, image_hook=toolkit_dir() / "nvidia-ctk")
    assert hook_check(dynamic).status is Status.FAIL
    assert hook_check(old_host).status is Status.FAIL


def test_combined_hook_is_judged_like_the_hook(tmp_path: Path) -> None:
    """Containers also run the image's flexgpu-cdi-hooks on the host (the hooks of a spec in
    one call): both static is fine on any host; a dynamically linked one on a host whose glibc
    is too old fails, naming that program."""
    from tests.nvidia_ctk import tools_dir as toolkit_dir

    hook, combined = toolkit_dir() / "nvidia-cdi-hook", toolkit_dir() / "flexgpu-cdi-hooks"
    _host(tmp_path, {"lib64/libc.so.6": b"GLIBC_2.17\x00GLIBC_2.28"})
    both = NodeFacts(tmp_path, tmp_path, image_hook=hook, image_combined_hook=combined)
    assert hook_check(both) == Check(
        "cdi-hook", Status.OK, "the image's hooks are statically linked: any host runs them"
    )
    # nvidia-ctk stands in for a dynamically linked build of the combined program.
    dynamic = NodeFacts(
        tmp_path, tmp_path, image_hook=hook, image_combined_hook=toolkit_dir() / "nvidia-ctk"
    )
    check = hook_check(dynamic)
    assert check.status is Status.FAIL
    assert "the image's nvidia-ctk needs glibc" in check.detail
    assert "nvidia-cdi-hook needs" not in check.detail
