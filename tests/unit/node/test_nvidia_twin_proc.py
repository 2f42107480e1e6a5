"""What NVIDIA's plugin reads under /proc on the real node (tools/nvidia_twin/node_plugin.py) and
the simulated driver's nvidia-smi (tools/node/driver_root.py): the /proc view lists, for every
MIG access file of the driver root's mig-minors, a capabilities file with the same minor, and a
/proc/devices whose nvidia-caps major NVIDIA's parser finds; nvidia-smi takes the time-slicing
settings and nothing else."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tools.node import driver_root
from tools.nvidia_twin.node_plugin import proc_view

MIG_MINORS = """config 1
monitor 2
gpu0/gi0/access 3
gpu0/gi0/ci0/access 4
gpu6/gi9/access 213
gpu6/gi9/ci0/access 214
"""


def _driver_proc(root: Path) -> Path:
    caps = root / "proc" / "driver" / "nvidia-caps"
    caps.mkdir(parents=True)
    (caps / "mig-minors").write_text(MIG_MINORS)
    return root


def test_capabilities_files_carry_the_minors_of_mig_minors(tmp_path: Path) -> None:
    proc_driver, _ = proc_view(_driver_proc(tmp_path / "root"), tmp_path / "out")
    caps = proc_driver / "nvidia" / "capabilities"
    expected = {
        "gpu0/mig/gi0/access": 3,
        "gpu0/mig/gi0/ci0/access": 4,
        "gpu6/mig/gi9/access": 213,
        "gpu6/mig/gi9/ci0/access": 214,
    }
    found = {
        str(path.relative_to(caps)): int(
            re.search(r"DeviceFileMinor: (\d+)", path.read_text()).group(1)  # type: ignore[union-attr]
        )
        for path in caps.rglob("access")
    }
    assert found == expected
    # The driver root's own listing stays readable where flexgpu's CDI code reads it.
    assert (proc_driver / "nvidia-caps" / "mig-minors").read_text() == MIG_MINORS


def test_proc_devices_names_the_caps_major_where_nvidia_parses_it(tmp_path: Path) -> None:
    _, devices = proc_view(_driver_proc(tmp_path / "root"), tmp_path / "out")
    text = devices.read_text()
    # NVIDIA's GetDeviceMajor: the first "<n> nvidia-caps\n" between the two section headers.
    match = re.search(r"(?s)Character devices:.*?([0-9]+) nvidia-caps\n.*Block devices:", text)
    assert match is not None, text
    assert int(match.group(1)) == driver_root.CAPS_MAJOR


def test_simulated_nvidia_smi_takes_time_slicing_settings_only(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(driver_root.NVIDIA_SMI.format(version=driver_root.DRIVER_VERSION))
    smi.chmod(0o755)

    def run(*args: str) -> int:
        return subprocess.run([str(smi), *args], capture_output=True, check=False).returncode

    # NVIDIA's plugin's two calls, and flexgpu's NVML backend's spelling of the second.
    assert run("-i", "GPU-1", "-c", "DEFAULT") == 0
    assert run("compute-policy", "-i", "GPU-1", "--set-timeslice", "3") == 0
    assert run("compute-policy", "-i", "GPU-1", "--set-timeslice=3") == 0
    assert run("-L") == 9
    assert run("compute-policy", "-l") == 9
