"""CDI specs as a GPU node's container runtime receives them: one CDI device per allocated
device, the driver's edits from NVIDIA's generator over a driver root, MIG capability nodes,
no variable two claims set differently; every spec loads with the upstream CDI library."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.cdi import ENV_DEVICE_PREFIX, parse_device_env_value
from flexgpu.kubelet_plugin.devices import driver_edits
from flexgpu.kubelet_plugin.devices.device_nodes import DeviceNodes
from tests.nvidia_ctk import cdi_devices, tools_dir
from tests.unit.kubelet_plugin.prepare_support import (
    DYNAMIC_GPU,
    SHARED_GPU,
    ClaimTable,
    Node,
    device,
    share,
    time_slicing,
)
from tools.node import driver_root

HOST_ROOT = Path("/run/nvidia/driver")  # where the host has the driver the plugin sees at root
CAPS_MAJOR = 511


@pytest.fixture
def driver(tmp_path: Path) -> Path:
    root = tmp_path / "driver"
    driver_root.create(root, 8)
    return root


@pytest.fixture
def node(tmp_path: Path, driver: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    monkeypatch.setenv("PATH", f"{tools_dir()}:{os.environ['PATH']}")
    node = Node(tmp_path, ClaimTable())
    hook = driver_edits.install_hook(node.data_dir)
    node.preparer.driver_edits = driver_edits.generate(
        driver_root=driver, host_driver_root=HOST_ROOT, hook_path=hook
    )
    node.devices.nodes = DeviceNodes(driver, HOST_ROOT, with_control_nodes=False)
    return node


def _spec(node: Node, uid: str) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(node.preparer.spec_path(uid).read_text())
    return spec


def _device_env(edits: dict[str, Any]) -> dict[str, str]:
    return dict(str(e).split("=", 1) for e in edits.get("env", []))


def test_one_cdi_device_per_allocated_device_and_all_load_with_the_cdi_library(
    node: Node,
) -> None:
    two = node.table.add("two", device("gpu-0", "a"), device("gpu-3", "b"))
    mig = node.table.add("mig", device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-6", "m"))
    shares = node.table.add(
        "shares",
        share(f"gpu-{SHARED_GPU}", "s1", "8Gi"),
        share(f"gpu-{SHARED_GPU}", "s2", "8Gi"),
    )
    sliced = node.table.add("sliced", device("gpu-4"), configs=(time_slicing("Long"),))
    results = node.preparer.prepare([two, mig, shares, sliced])
    assert all(not r.error for r in results.values()), results

    returned = [i for r in results.values() for d in r.devices for i in d.cdi_device_ids]
    # Each device its own CDI device; the first device of each request (five requests) also
    # the one that mounts the request's device metadata file.
    assert all(len(d.cdi_device_ids) in {1, 2} for r in results.values() for d in r.devices)
    assert len(returned) == len(set(returned)) == 6 + 5
    assert len([i for i in returned if "_metadata_" in i]) == 5
    # What the runtime would resolve: exactly the devices the kubelet was told about.
    assert cdi_devices(node.root / "cdi") == sorted(returned)

    by_request = {d.request_names: d for d in results[two.uid].devices}
    assert by_request[("a",)].cdi_device_ids == (
        f"gpu.flexgpu.dev/claim={two.uid}-gpu-0",
        f"gpu.flexgpu.dev/claim={two.uid}_metadata_a",
    )
    spec = _spec(node, two.uid)
    per_device = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    # A container naming request "a" gets gpu-0's node and nothing of gpu-3.
    assert [n["path"] for n in per_device[f"{two.uid}-gpu-0"]["deviceNodes"]] == ["/dev/nvidia0"]
    assert per_device[f"{two.uid}-gpu-0"]["deviceNodes"][0] == {
        "path": "/dev/nvidia0",
        "hostPath": f"{HOST_ROOT}/dev/nvidia0",
        "type": "c",
        "major": driver_root.NVIDIA_MAJOR,
        "minor": 0,
    }


def test_the_driver_edits_come_from_nvidias_generator_with_host_paths(
    node: Node, driver: Path
) -> None:
    ref = node.table.add("one", device("gpu-0"))
    assert not node.preparer.prepare([ref])[ref.uid].error
    common = _spec(node, ref.uid)["containerEdits"]
    mounts = {m["containerPath"]: m["hostPath"] for m in common["mounts"]}
    lib = f"/{driver_root.LIB_DIR}/libcuda.so.{driver_root.DRIVER_VERSION}"
    assert mounts[lib] == f"{HOST_ROOT}{lib}"
    assert mounts["/usr/bin/nvidia-smi"] == f"{HOST_ROOT}/usr/bin/nvidia-smi"
    assert mounts["/usr/bin/nvidia-cuda-mps-control"].startswith(str(HOST_ROOT))
    assert not any(str(driver) in path for path in mounts.values())
    hooks = {tuple(h["args"][:2]) for h in common["hooks"]}
    assert {("nvidia-cdi-hook", "update-ldcache"), ("nvidia-cdi-hook", "create-symlinks")} <= hooks
    assert {h["path"] for h in common["hooks"]} == {str(node.data_dir / "bin/nvidia-cdi-hook")}
    assert (node.data_dir / "bin/nvidia-cdi-hook").stat().st_mode & stat.S_IXUSR
    control = {n["path"] for n in common["deviceNodes"]}
    assert control == {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    assert "NVIDIA_VISIBLE_DEVICES=void" in common["env"]


def test_no_variable_is_set_by_two_claims_with_different_values(node: Node) -> None:
    first = node.table.add("first", device("gpu-0"))
    second = node.table.add("second", device("gpu-5"), configs=(time_slicing("Short"),))
    results = node.preparer.prepare([first, second])
    assert all(not r.error for r in results.values())
    seen: dict[str, set[str]] = {}
    for uid in (first.uid, second.uid):
        spec = _spec(node, uid)
        for edits in [spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])]:
            for key, value in _device_env(edits).items():
                seen.setdefault(key, set()).add(value)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
    # A container with both claims sees both GPUs, each named by its own variable.
    own = {k: parse_device_env_value(next(iter(v))) for k, v in seen.items()}
    got = {f["device"]: f for k, f in own.items() if k.startswith(ENV_DEVICE_PREFIX)}
    assert set(got) == {"gpu-0", "gpu-5"}
    assert got["gpu-0"]["claim"] == "ns/first" and got["gpu-5"]["timeSlice"] == "Short"
    assert seen["NVIDIA_VISIBLE_DEVICES"] == {"void"}


def test_a_mig_device_gets_its_capability_nodes(node: Node, driver: Path) -> None:
    gpu = DYNAMIC_GPU
    minors = "".join(
        f"gpu{gpu}/gi{gi}/access {100 + gi}\ngpu{gpu}/gi{gi}/ci0/access {200 + gi}\n"
        for gi in range(8)
    )
    (driver / "proc/driver/nvidia-caps").mkdir(parents=True)
    (driver / "proc/driver/nvidia-caps/mig-minors").write_text("config 1\nmonitor 2\n" + minors)
    (driver / "proc/devices").write_text(
        f"Character devices:\n195 nvidia\n{CAPS_MAJOR} nvidia-caps\n\nBlock devices:\n"
    )
    ref = node.table.add("mig", device(f"gpu-{gpu}-mig-3g40gb-4"))
    assert not node.preparer.prepare([ref])[ref.uid].error
    (instance,) = node.backend.list_mig_devices(gpu)
    cdi, metadata = _spec(node, ref.uid)["devices"]
    gi = instance.gpu_instance_id
    assert cdi["containerEdits"]["deviceNodes"] == [
        {
            "path": f"/dev/nvidia{gpu}",
            "hostPath": f"{HOST_ROOT}/dev/nvidia{gpu}",
            "type": "c",
            "major": driver_root.NVIDIA_MAJOR,
            "minor": gpu,
        },
        {
            "path": f"/dev/nvidia-caps/nvidia-cap{100 + gi}",
            "type": "c",
            "major": CAPS_MAJOR,
            "minor": 100 + gi,
        },
        {
            "path": f"/dev/nvidia-caps/nvidia-cap{200 + gi}",
            "type": "c",
            "major": CAPS_MAJOR,
            "minor": 200 + gi,
        },
    ]
    fields = parse_device_env_value(_device_env(cdi["containerEdits"]).popitem()[1])
    assert fields["uuid"] == instance.uuid and fields["uuid"].startswith("MIG-")
    assert cdi_devices(node.root / "cdi") == [
        f"gpu.flexgpu.dev/claim={name}" for name in (cdi["name"], metadata["name"])
    ]


def test_a_missing_generator_is_named_with_its_setting(tmp_path: Path, driver: Path) -> None:
    with pytest.raises(driver_edits.DriverEditsError) as info:
        driver_edits.generate(
            driver_root=driver,
            host_driver_root=driver,
            hook_path=Path("/usr/bin/nvidia-cdi-hook"),
            generator=str(tmp_path / "nowhere" / "flexgpu-cdi-common"),
        )
    assert str(info.value).startswith("--cdi-generator (FLEXGPU_CDI_GENERATOR): ")
    assert "is not an executable file nor in PATH" in str(info.value)


def test_a_missing_hook_is_named_with_its_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(driver_edits.DriverEditsError) as info:
        driver_edits.install_hook(tmp_path / "data")
    assert str(info.value).startswith("--nvidia-cdi-hook (FLEXGPU_NVIDIA_CDI_HOOK) is unset")


def test_a_broken_driver_root_fails_with_the_generators_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{tools_dir()}:{os.environ['PATH']}")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(driver_edits.DriverEditsError) as info:
        driver_edits.generate(
            driver_root=empty, host_driver_root=empty, hook_path=Path("/usr/bin/hook")
        )
    assert f"over --driver-root {empty}" in str(info.value)
    assert "driver version" in str(info.value)
