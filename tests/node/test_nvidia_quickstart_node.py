"""NVIDIA's quickstart manifests on the real node: gpu-test1, gpu-test2 and gpu-test3 of
NVIDIA's DRA driver v0.4.1, applied with kubectl byte for byte as NVIDIA publishes them (read
from the module's source in the Go module cache) while NVIDIA's plugin runs on the node, then
flexgpu's copies of them (tests/integration/nvidia_quickstart: only the driver's names
changed, checked here) against flexgpu's chart-installed plugin. Their containers run
``bash -c "nvidia-smi -L; ...; sleep 9999 & wait"`` in ``ubuntu:22.04``, which the node knows
as the Debian stand-in tools/images builds under that name (no public registry is reachable).

For each container: its own output (the driver's ``nvidia-smi``, which only the CDI edits put
there), what it received from inside (the report script of tools/images run in it through the
runtime: environment, device nodes and whether they open, driver files, mounts), and whether
the manifest does what NVIDIA's quickstart says (gpu-test1: two pods, distinct GPUs; gpu-test2:
two containers of one pod, one GPU; gpu-test3: two pods sharing one claim's GPU). What differs
between the drivers is listed with its reason in docs/nvidia-differential.md ("NVIDIA's
quickstart manifests on the real node"); an unlisted or stale difference fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.node.conftest import NODE
from tests.node.nvidia_node import nvidia_plugin
from tests.node.quickstart_runs import Run, Runs, quickstart_specs, run_manifests, undocumented
from tests.node.support import assert_control_nodes_usable
from tests.nvidia_machine import machine
from tools.images.build import UBUNTU_STANDIN
from tools.node.node import RealNode
from tools.nvidia_twin.quickstart import FLEXGPU_COPIES, name_changes

pytestmark = pytest.mark.integration

MANIFESTS = ("gpu-test1", "gpu-test2", "gpu-test3")
LABELS = ("nvidia", "flexgpu")
# What the simulated driver's nvidia-smi answers to `-L` (tools/node/driver_root.py): the
# program the driver root installs, found on the container's PATH only through the CDI edits.
DRIVER_SMI = "nvidia-smi: simulated NVIDIA driver"


@pytest.fixture(scope="module")
def specs() -> Path:
    return quickstart_specs()


@pytest.fixture(scope="module")
def runs(plugin: RealNode, specs: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    folder = Path(tmp_path_factory.mktemp("nvquickstart-node"))
    with nvidia_plugin(plugin, machine(folder, mig_layouts=False)) as component:
        try:
            nvidia = run_manifests(plugin, [specs / f"{m}.yaml" for m in MANIFESTS])
        except BaseException:
            print(component.log_tail(60))
            raise
        flexgpu = run_manifests(plugin, [FLEXGPU_COPIES / f"{m}.yaml" for m in MANIFESTS])
    return {"nvidia": nvidia, "flexgpu": flexgpu}


def test_flexgpu_copies_change_only_the_drivers_names(specs: Path) -> None:
    """Every quickstart manifest flexgpu keeps a copy of equals NVIDIA's once NVIDIA's class,
    attribute domain, driver and apiVersion names are renamed; comments aside."""
    copies = sorted(FLEXGPU_COPIES.glob("gpu-test*.yaml"))
    assert {p.stem for p in copies} >= set(MANIFESTS)
    for copy in copies:
        assert name_changes(specs / copy.name, copy) == [], copy.name


def test_containers_run_the_standin_image_on_the_real_node(runs: Runs) -> None:
    for label, by_manifest in runs.items():
        for name, run in by_manifest.items():
            for where, seen in run.containers.items():
                assert seen.node == NODE, f"{label} {name} {where} ran on {seen.node}"
                assert seen.image == UBUNTU_STANDIN, f"{label} {name} {where}: {seen.image}"


def test_each_container_ran_the_drivers_nvidia_smi(runs: Runs) -> None:
    """`nvidia-smi -L`, the manifests' first command, is not in the image: it runs only where
    the driver's CDI edits mounted the driver root's program, which answers that no GPU is
    here. The container's devices are checked from inside instead (the tests below)."""
    for label, by_manifest in runs.items():
        for name, run in by_manifest.items():
            for where, seen in run.containers.items():
                assert DRIVER_SMI in seen.log, f"{label} {name} {where}: {seen.log[-500:]}"
                assert "/usr/bin/nvidia-smi" in seen.report.files, (label, name, where)
                assert_control_nodes_usable(seen.report)


def _gpus(run: Run) -> dict[str, list[str]]:
    """Per container, its GPU device nodes; each must open (its device cgroup allows it)."""
    found = {}
    for where, seen in run.containers.items():
        nodes = seen.report.gpu_nodes()
        assert all(seen.report.devices[p].cgroup_allows for p in nodes), (where, nodes)
        found[where] = nodes
    return found


@pytest.mark.parametrize("label", LABELS)
def test_gpu_test1_gives_each_pod_its_own_gpu(runs: Runs, label: str) -> None:
    run = runs[label]["gpu-test1"]
    gpus = _gpus(run)
    assert sorted(gpus) == ["pod1/ctr", "pod2/ctr"]
    assert all(len(nodes) == 1 for nodes in gpus.values()), gpus
    assert gpus["pod1/ctr"] != gpus["pod2/ctr"], f"both pods got {gpus['pod1/ctr']}"
    assert sorted(run.reserved.values()) == [["pod1"], ["pod2"]], run.reserved


@pytest.mark.parametrize("label", LABELS)
def test_gpu_test2_containers_of_one_pod_share_one_gpu(runs: Runs, label: str) -> None:
    run = runs[label]["gpu-test2"]
    gpus = _gpus(run)
    assert sorted(gpus) == ["pod/ctr0", "pod/ctr1"]
    assert len(gpus["pod/ctr0"]) == 1 and gpus["pod/ctr0"] == gpus["pod/ctr1"], gpus
    assert list(run.reserved.values()) == [["pod"]], run.reserved


@pytest.mark.parametrize("label", LABELS)
def test_gpu_test3_pods_share_the_claims_gpu(runs: Runs, label: str) -> None:
    run = runs[label]["gpu-test3"]
    gpus = _gpus(run)
    assert sorted(gpus) == ["pod1/ctr", "pod2/ctr"]
    assert len(gpus["pod1/ctr"]) == 1 and gpus["pod1/ctr"] == gpus["pod2/ctr"], gpus
    assert run.reserved == {"single-gpu": ["pod1", "pod2"]}


def test_containers_differ_only_where_documented(runs: Runs) -> None:
    """Each container of NVIDIA's run is compared with the same container of flexgpu's; a row
    of the table names the manifest, what differs and the containers it differs in."""
    wrong = undocumented(runs, MANIFESTS)
    assert not wrong, wrong
