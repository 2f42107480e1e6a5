"""flexgpu's publication against NVIDIA's own DRA kubelet plugin (sigs.k8s.io/dra-driver-nvidia-gpu
v0.4.1, tools/nvidia-driver) on the same GPUs: each runs on its own simulated node of the test
world over the same NVML mock machine (a DGX H100; two of its GPUs in MIG mode with layouts made
beforehand, as mig-parted leaves them) in the same driver root, and the ResourceSlices each
publishes are compared device by device — names, attributes, capacities, counter consumption,
shared counters, MIG profiles and placements, static (NVIDIA's chart's gates) and dynamic
(NVIDIA's DynamicMIG, flexgpu's --dynamic-mig-gpus=all) — and health: the same Xids (79, 48,
13) injected and the same GPU lost on both machines, and what each then publishes (and what
each plugin's process takes while the GPU stays lost). Every difference must be listed with
its reason in docs/nvidia-differential.md; an unlisted one, or a listed one that no longer
exists, fails the test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.procstat import cpu_seconds
from tests.integration.nvidia_differential import (
    DOC,
    Published,
    RowKey,
    differences,
    documented,
    reduce,
    render,
)
from tests.nvidia_ctk import tools_dir
from tests.nvidia_machine import GPUS, LAYOUTS, MACHINE, machine, own_copy
from tests.nvidia_plugin import nvidia_binary
from tests.nvml_library import MockMachine, library_dir
from tools.cluster import ControlPlane
from tools.node import driver_root
from tools.nvidia_twin import (
    DYNAMIC_MIG_GATES,
    STATIC_GATES,
    TwinPlugin,
    flexgpu_twin,
    nvidia_twin,
)

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Configuration:
    name: str
    nvidia_gates: str
    flexgpu_dynamic_mig: bool
    mig_layouts: bool


CONFIGURATIONS = (
    Configuration("static", STATIC_GATES, flexgpu_dynamic_mig=False, mig_layouts=True),
    Configuration("dynamic", DYNAMIC_MIG_GATES, flexgpu_dynamic_mig=True, mig_layouts=False),
)
# Health, on the static pair once compared: the same faults on both machines. Xid 79 (fallen
# off the bus) and 48 (double-bit ECC error) are fatal; 13 (a graphics engine exception) is one a
# workload causes itself; GPU 4 is then lost (NVML answers GPU_IS_LOST for it).
HEALTH = "health"
# bench/scale_publications.py's NVIDIA-style publication, set against the real one.
IMITATION = "imitation"
# Where the imitation may differ from NVIDIA's plugin over this mock: NVIDIA counts a GPU's
# memory slices from its largest placement (7 in NVIDIA's mock, whose 7g spans 0:7), the
# imitation from the GPU's real count (8 on every GPU the catalog holds).
IMITATION_ALLOWED = {"consumes memory-slice-7", "counter memory-slice-7"}
XIDS = ((1, 79), (2, 13), (3, 48))
LOST_GPUS = (4,)
CHANGE_TIMEOUT_S = 60.0
# flexgpu's health loop blocks in NVML's event wait while a GPU is lost (on a set without it);
# one that asked a set answering GPU_IS_LOST again at once would take a whole core.
FLEXGPU_CORES_WHILE_LOST = 0.3


def _serialized(api: Any, slices: list[Any], keep: Path | None = None) -> list[dict[str, Any]]:
    """The slices as the API serves them; ``keep`` stores them for a person to read."""
    served = [api.sanitize_for_serialization(item) for item in slices]
    if keep is not None:
        keep.write_text(json.dumps(served, indent=1, sort_keys=True))
    return served


DUMP_GPU = """
import json, sys
from flexgpu.driver.nvml_backend import NvmlBackend
backend = NvmlBackend()
backend.set_mig_mode(0, True)  # NVML lists MIG profiles only with MIG mode on
gpu = backend.list_gpus()[0]
profiles = backend.mig_profiles(0)
print(json.dumps({"gpu": gpu.model_dump(mode="json"),
                  "profiles": [p.model_dump(mode="json") for p in profiles]}))
backend.close()
"""


def _imitation(folder: Path) -> Published:
    """bench.scale_publications' NVIDIA-style devices and counters for GPU 0 of the same
    machine, from what flexgpu's NVML backend reads there (in a process of its own, on a
    throwaway state)."""
    from bench.scale_publications import nvidia_gpu
    from flexgpu.driver.gpu_model import GpuInfo, MigProfile

    made = MockMachine.write(folder, json.loads(json.dumps(MACHINE)))
    done = subprocess.run(
        [sys.executable, "-c", DUMP_GPU],
        env={**made.env(), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    read = json.loads(done.stdout)
    gpu = GpuInfo.model_validate(read["gpu"])
    profiles = [MigProfile.model_validate(p) for p in read["profiles"]]
    devices, counters = nvidia_gpu(gpu, profiles)
    return reduce("nvidia", [{"spec": {"devices": devices, "sharedCounters": [counters]}}])


def _republished(api: Any, plugin: TwinPlugin, driver: str, before: Published) -> Published:
    """The plugin's publication once it changed after the injected Xids (and settled), or as
    it stands after CHANGE_TIMEOUT_S when it does not change: not reacting is a result too."""
    deadline = time.monotonic() + CHANGE_TIMEOUT_S
    while time.monotonic() < deadline:
        now = reduce(driver, _serialized(api, plugin.slices(api)))
        if now.devices != before.devices or now.counter_sets != before.counter_sets:
            break
        time.sleep(0.5)
    return reduce(driver, _serialized(api, plugin.wait_published(api)))


@dataclass
class Usage:
    """What one plugin's process took while GPU 4 was lost: CPU in cores, log in bytes/s."""

    cores: float
    log_bytes_per_s: float


class Meter:
    """CPU time and log size of one plugin's process from ``start`` on."""

    def __init__(self, plugin: TwinPlugin) -> None:
        assert plugin.component is not None and plugin.component.proc is not None
        self.pid, self.log = plugin.component.proc.pid, plugin.log
        self.started = time.monotonic()
        self.cpu, self.size = cpu_seconds(self.pid), self.log.stat().st_size

    def usage(self) -> Usage:
        elapsed = time.monotonic() - self.started
        return Usage(
            (cpu_seconds(self.pid) - self.cpu) / elapsed,
            (self.log.stat().st_size - self.size) / elapsed,
        )


@pytest.fixture(scope="module")
def lost_gpu_usage() -> dict[str, Usage]:
    """Each plugin's usage while GPU 4 was lost, filled in by ``publications``."""
    return {}


@pytest.fixture(scope="module")
def publications(
    cluster: ControlPlane,
    api: Any,
    tmp_path_factory: pytest.TempPathFactory,
    lost_gpu_usage: dict[str, Usage],
) -> Iterator[dict[str, tuple[Published, Published]]]:
    binary = nvidia_binary()
    hook = tools_dir() / "nvidia-cdi-hook"
    base = Path(tmp_path_factory.mktemp("nvtwin"))
    root = driver_root.create(base / "driver", GPUS, library_dir() / "libnvidia-ml.so.1").root
    results: dict[str, tuple[Published, Published]] = {}
    running: list[TwinPlugin] = []
    try:
        for configuration in CONFIGURATIONS:
            folder = base / configuration.name
            made = machine(folder / "machine", mig_layouts=configuration.mig_layouts)
            nvidia_machine = own_copy(made, folder / "nvidia-state")
            flexgpu_machine = own_copy(made, folder / "flexgpu-state")
            nvidia = nvidia_twin(
                binary,
                f"nv-{configuration.name}",
                folder / "nvidia",
                cluster.kubeconfig,
                driver_root=root,
                cdi_hook=hook,
                machine_env=nvidia_machine.env(),
                feature_gates=configuration.nvidia_gates,
            )
            flexgpu = flexgpu_twin(
                f"fg-{configuration.name}",
                folder / "flexgpu",
                cluster.kubeconfig,
                driver_root=root,
                cdi_hook=hook,
                machine_env=flexgpu_machine.env(),
                dynamic_mig=configuration.flexgpu_dynamic_mig,
            )
            for plugin in (nvidia, flexgpu):
                running.append(plugin)
                plugin.start(api)
            theirs = reduce(
                "nvidia", _serialized(api, nvidia.wait_published(api), folder / "nvidia.json")
            )
            ours = reduce(
                "flexgpu", _serialized(api, flexgpu.wait_published(api), folder / "flexgpu.json")
            )
            results[configuration.name] = (theirs, ours)
            if configuration.name == "dynamic":
                results[IMITATION] = (theirs, _imitation(folder / "imitation"))
            if configuration.name == "static":
                for machine_copy in (nvidia_machine, flexgpu_machine):
                    for gpu, xid in XIDS:
                        machine_copy.inject_xid(gpu, xid)
                    for gpu in LOST_GPUS:
                        machine_copy.set_lost(gpu)
                meters = {"nvidia": Meter(nvidia), "flexgpu": Meter(flexgpu)}
                results[HEALTH] = (
                    _republished(api, nvidia, "nvidia", theirs),
                    _republished(api, flexgpu, "flexgpu", ours),
                )
                lost_gpu_usage.update({name: m.usage() for name, m in meters.items()})
            for plugin in (nvidia, flexgpu):
                plugin.stop()
        yield results
    finally:
        for plugin in running:
            plugin.remove(api)


def _measured(publications: dict[str, tuple[Published, Published]]) -> dict[RowKey, str]:
    rows: dict[RowKey, str] = {}
    for name, (theirs, ours) in publications.items():
        if name not in {HEALTH, IMITATION}:
            rows.update(differences(name, theirs, ours))
    # After the faults: only what is not already a "static" row. Every GPU is compared, not
    # only the faulty ones: a driver may taint more than the GPU concerned (NVIDIA taints
    # every device when NVML reports a GPU lost without saying which).
    static = {(field, a, b) for configuration, field, a, b in rows if configuration == "static"}
    theirs, ours = publications[HEALTH]
    for key, kinds in differences(HEALTH, theirs, ours).items():
        if key[1:] not in static:
            rows[key] = kinds
    return rows


def test_both_publish_every_gpu_of_the_machine(
    publications: dict[str, tuple[Published, Published]],
) -> None:
    for name, (theirs, ours) in publications.items():
        if name in {HEALTH, IMITATION}:
            continue
        for published in (theirs, ours):
            parents = {key[0] for key in published.devices}
            assert parents == set(range(GPUS)), f"{name}: devices of GPUs {sorted(parents)}"
    # NVIDIA's plugin sees the static layouts, placement for placement (what flexgpu
    # publishes for those GPUs is in the table).
    theirs, _ = publications["static"]
    for gpu, instances in LAYOUTS.items():
        wanted = sorted(start for _, start, _ in instances)
        starts = sorted(key[2] for key in theirs.devices if key[0] == gpu)
        assert starts == wanted, f"GPU {gpu}: NVIDIA's MIG devices at {starts}"


def test_publications_differ_only_where_documented(
    publications: dict[str, tuple[Published, Published]],
) -> None:
    measured = _measured(publications)
    listed = documented()
    unlisted = {key: kinds for key, kinds in measured.items() if key not in listed}
    stale = sorted(key for key in listed if key not in measured)
    assert not unlisted and not stale, (
        f"{DOC.name} is out of date.\nunlisted differences (measured):\n{render(unlisted)}\n"
        f"listed but no longer measured: {stale}"
    )
    # Every row whose devices moved at once, so one run says all that needs rewriting.
    moved = [
        f"{key}: concerns {kinds}, the table says {listed[key].devices}"
        for key, kinds in measured.items()
        if listed[key].devices != kinds
    ]
    assert not moved, "\n".join(moved)
    for key in measured:
        assert listed[key].reason, f"{key}: the table must give the reason for the difference"


def test_flexgpu_stays_idle_while_a_gpu_is_lost(
    publications: dict[str, tuple[Published, Published]], lost_gpu_usage: dict[str, Usage]
) -> None:
    """Measured over the health comparison (GPU 4 lost, from the faults until both plugins'
    slices settled); NVIDIA's figures are printed for docs/nvidia-differential.md."""
    figures = ", ".join(
        f"{name} {u.cores:.2f} cores, log {u.log_bytes_per_s / 1024:.0f} KiB/s"
        for name, u in sorted(lost_gpu_usage.items())
    )
    print(f"while GPU 4 is lost: {figures}")
    assert lost_gpu_usage["flexgpu"].cores <= FLEXGPU_CORES_WHILE_LOST, figures


def test_table_parser_reads_the_document() -> None:
    rows = documented()
    assert rows, f"{DOC.name} has no rows between the markers"
    assert {configuration for configuration, *_ in rows} <= {c.name for c in CONFIGURATIONS} | {
        HEALTH
    }


def test_benchmark_imitation_publishes_what_nvidia_does(
    publications: dict[str, tuple[Published, Published]],
) -> None:
    """The scale benchmark's NVIDIA-style slices (bench/scale_publications.py, written from
    NVIDIA's behaviour) hold, for GPU 0, the devices, capacities, counter consumption and
    shared counters NVIDIA's plugin publishes under DynamicMIG; attributes are flexgpu's by
    design there and are not compared."""
    real, imitation = publications[IMITATION]
    mine = {key: record for key, record in real.devices.items() if key[0] == 0}
    assert set(imitation.devices) == set(mine), (
        f"devices only NVIDIA publishes: {sorted(set(mine) - set(imitation.devices))}; "
        f"only the imitation: {sorted(set(imitation.devices) - set(mine))}"
    )
    wrong = []
    for key, record in mine.items():
        copy = imitation.devices[key]
        for field in sorted(record.keys() | copy.keys()):
            if field.startswith("attribute ") or field in IMITATION_ALLOWED:
                continue
            if record.get(field) != copy.get(field):
                wrong.append((key, field, record.get(field), copy.get(field)))
    for field in sorted(real.counter_sets[0].keys() | imitation.counter_sets[0].keys()):
        theirs, ours = real.counter_sets[0].get(field), imitation.counter_sets[0].get(field)
        if field not in IMITATION_ALLOWED and theirs != ours:
            wrong.append(((0, "counters", -1), field, theirs, ours))
    assert not wrong, f"(device, field, NVIDIA, imitation): {wrong}"
