"""The machine both twins run on in the NVIDIA differential tests: NVIDIA's DGX H100 mock server
described for the NVML mock library, optionally with the MIG layouts mig-parted leaves made
beforehand in the library's state, and per-node copies of that state."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.nvml_library import MockMachine

GPUS = 8
# A DGX H100 as it reports itself on an x86 host with NVIDIA's open kernel modules (HMM on).
MACHINE: dict[str, Any] = {
    "machine": "dgxh100",
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "addressingMode": "HMM",
    "gpus": [
        {"model": "H100-SXM5-80GB", "pciBusId": f"0000:{0x18 + i:02x}:00.0"} for i in range(GPUS)
    ],
    "nvswitch": {"gpus": list(range(GPUS)), "links": 18},
}
# mig-parted's "all-1g.10gb" on GPU 6 and "all-balanced" on GPU 7: (profile id, start, size),
# sizes as NVIDIA's mock tables give them (its 3g spans 3 slices where an H100's spans 4).
LAYOUTS = {
    6: [(19, start, 1) for start in range(7)],
    7: [(9, 4, 3), (14, 0, 2), (19, 2, 1), (19, 3, 1)],
}
CREATE_LAYOUT = """
import json, sys
from flexgpu.driver.gpu_model import MigPlacement
from flexgpu.driver.nvml_backend import NvmlBackend
backend = NvmlBackend()
for gpu, instances in json.loads(sys.argv[1]).items():
    for profile, start, size in instances:
        backend.create_mig_device(int(gpu), profile, MigPlacement(start=start, size=size))
backend.close()
"""


def machine(folder: Path, *, mig_layouts: bool) -> MockMachine:
    """The DGX H100 in ``folder``; with ``mig_layouts`` GPUs 6 and 7 are in MIG mode with
    LAYOUTS already created, as mig-parted leaves a node before any DRA driver starts."""
    description = json.loads(json.dumps(MACHINE))
    if mig_layouts:
        for gpu in LAYOUTS:
            description["gpus"][gpu]["migEnabled"] = True
    made = MockMachine.write(folder, description)
    if mig_layouts:
        # In a process of its own: the library reads its machine at a process's first nvmlInit.
        subprocess.run(
            [sys.executable, "-c", CREATE_LAYOUT, json.dumps(LAYOUTS)],
            env={**made.env(), "PATH": "/usr/bin:/bin"},
            check=True,
            timeout=120,
        )
    return made


def own_copy(source: MockMachine, folder: Path) -> MockMachine:
    """The same machine with its own state file, MIG UUIDs included: what one plugin changes
    the other does not see, as on two identical nodes."""
    folder.mkdir(parents=True, exist_ok=True)
    state = folder / "nvml-state.json"
    if source.state_path.exists():
        shutil.copy2(source.state_path, state)
    return MockMachine(config_path=source.config_path, state_path=state)


# NVIDIA's quickstart node after `nvidia-mig-parted apply -c half-balanced` (its
# mig-parted-config.yaml): a DGX A100 whose MIG GPUs each hold 3g.20gb, 2g.10gb and two
# 1g.5gb, at the one arrangement an A100 40GB allows (profile, first memory slice).
A100_MACHINE: dict[str, Any] = {
    "machine": "dgxa100",
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "gpus": [
        {"model": "A100-SXM4-40GB", "pciBusId": f"0000:{0x07 + 8 * i:02x}:00.0"}
        for i in range(GPUS)
    ],
    "nvswitch": {"gpus": list(range(GPUS)), "links": 12},
}
HALF_BALANCED = (("3g.20gb", 4), ("2g.10gb", 2), ("1g.5gb", 0), ("1g.5gb", 1))
CREATE_NAMED_LAYOUT = """
import json, sys
from flexgpu.driver.nvml_backend import NvmlBackend
backend = NvmlBackend()
for gpu, instances in json.loads(sys.argv[1]).items():
    profiles = {p.name: p for p in backend.mig_profiles(int(gpu))}
    for name, start in instances:
        (placement,) = [p for p in profiles[name].placements if p.start == start]
        backend.create_mig_device(int(gpu), profiles[name].profile_id, placement)
backend.close()
"""


def a100_half_balanced(folder: Path, mig_gpus: tuple[int, ...]) -> MockMachine:
    """NVIDIA's DGX A100 mock in ``folder`` with ``mig_gpus`` in MIG mode, each partitioned as
    HALF_BALANCED before any DRA driver starts."""
    description = json.loads(json.dumps(A100_MACHINE))
    for gpu in mig_gpus:
        description["gpus"][gpu]["migEnabled"] = True
    made = MockMachine.write(folder, description)
    subprocess.run(
        [
            sys.executable,
            "-c",
            CREATE_NAMED_LAYOUT,
            json.dumps(dict.fromkeys(mig_gpus, HALF_BALANCED)),
        ],
        env={**made.env(), "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=120,
    )
    return made
