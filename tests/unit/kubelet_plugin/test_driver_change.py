"""A driver change under the driver root: the fingerprint sees it, prepares are refused
naming both versions until every prepared claim's spec names the new driver's files, the
refresh runs beside prepares and unprepares of other claims, and a SIGKILL in it is finished
by the next start."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.cdi import (
    CdiDevice,
    ClaimIdentity,
    common_edits,
    render_claim_spec,
    with_driver_edits,
)
from flexgpu.driver.driver_version import read_fingerprint
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.driver_change import (
    CHANGED_REASON,
    FAILED_REASON,
    REGENERATED_REASON,
    DriverChange,
)
from flexgpu.kubelet_plugin.claims.pipeline import PREPARE, UNPREPARE
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.claims.startup_reconcile import reconcile_at_start
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from flexgpu.kubelet_plugin.observe.metrics import error_reason
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.prepare_support import (
    DYNAMIC_GPU,
    NODE,
    SHARED_GPU,
    ClaimTable,
    Node,
    device,
    mig_mps,
    share,
    time_slicing,
)

OLD, NEW = "580.95.05", "590.44.01"
LIBS = ("libnvidia-ml.so", "libcuda.so")
LIB_DIR = "usr/lib/x86_64-linux-gnu"


def install(root: Path, version: str) -> None:
    """Installs ``version`` as the driver's installer does: the versioned files, then the
    ``.so.1`` links moved over (a rename, never absent), then the old files removed."""
    libs = root / LIB_DIR
    libs.mkdir(parents=True, exist_ok=True)
    for lib in LIBS:
        (libs / f"{lib}.{version}").write_bytes(version.encode())
        temporary = libs / f".{lib}.1.new"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(f"{lib}.{version}")
        os.replace(temporary, libs / f"{lib}.1")
    for old in libs.glob("lib*.so.*.*"):
        if not old.name.endswith(f".so.{version}"):
            old.unlink()


def generated(root: Path) -> dict[str, Any]:
    """What NVIDIA's generator gives for the root: a mount of each versioned library."""
    found = sorted(p.name for p in (root / LIB_DIR).glob("lib*.so.*.*"))
    if not found:
        raise RuntimeError(f"no driver libraries under {root}")
    return {
        "mounts": [
            {"hostPath": f"/driver/{LIB_DIR}/{n}", "containerPath": f"/{LIB_DIR}/{n}"}
            for n in found
        ]
    }


def mounted(spec_path: Path) -> list[str]:
    spec = json.loads(spec_path.read_text())
    return [m["containerPath"] for m in spec["containerEdits"].get("mounts", [])]


def new_files() -> list[str]:
    return [f"/{LIB_DIR}/{lib}.{NEW}" for lib in sorted(LIBS)]


def old_files() -> list[str]:
    return [f"/{LIB_DIR}/{lib}.{OLD}" for lib in sorted(LIBS)]


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def __call__(self, reason: str, message: str, event_type: str) -> None:
        self.seen.append((reason, message, event_type))

    @property
    def reasons(self) -> list[str]:
        return [r for r, _, _ in self.seen]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "driver"
    install(root, OLD)
    return root


@pytest.fixture
def node(tmp_path: Path, root: Path) -> Node:
    (tmp_path / "node").mkdir()
    node = Node(tmp_path / "node", ClaimTable())
    node.preparer.driver_edits = generated(root)
    return node


def change_for(node: Node, root: Path, events: Events | None = None, **kw: Any) -> DriverChange:
    return DriverChange(
        root, read_fingerprint(root), node.preparer, lambda: generated(root), events=events, **kw
    )


def prepared(node: Node, ref: ClaimRef) -> Path:
    (result,) = node.preparer.prepare([ref]).values()
    assert result.error == "", result.error
    return node.preparer.spec_path(ref.uid)


# -- the fingerprint ---------------------------------------------------------------------


def test_the_fingerprint_names_the_version_the_nvml_link_points_at(root: Path) -> None:
    before = read_fingerprint(root)
    assert before is not None and before.version == OLD
    install(root, NEW)
    after = read_fingerprint(root)
    assert after is not None and after.version == NEW and after != before


def test_a_reinstall_of_the_same_version_is_a_change(root: Path) -> None:
    before = read_fingerprint(root)
    nvml = root / LIB_DIR / f"libnvidia-ml.so.{OLD}"
    nvml.unlink()
    nvml.write_bytes(b"reinstalled, one byte longer")
    after = read_fingerprint(root)
    assert after is not None and after.version == OLD and after != before


@pytest.mark.parametrize("state", ["no link", "link to nothing", "no version in the name"])
def test_a_root_half_way_through_a_swap_reads_as_no_driver(root: Path, state: str) -> None:
    link = root / LIB_DIR / "libnvidia-ml.so.1"
    link.unlink()
    if state == "link to nothing":
        link.symlink_to("libnvidia-ml.so.600.1.1")
    elif state == "no version in the name":
        (root / LIB_DIR / "libnvidia-ml.so.new").write_bytes(b"")
        link.symlink_to("libnvidia-ml.so.new")
    assert read_fingerprint(root) is None


# -- the spec rewrite (pure) ---------------------------------------------------------------


def test_a_rewritten_spec_keeps_its_devices_and_takes_the_new_common_edits(root: Path) -> None:
    claim = ClaimIdentity("uid-1", "ns", "c")
    spec = render_claim_spec(claim, [CdiDevice("gpu-0", "GPU-0")], generated(root), "boot")
    install(root, NEW)
    rewritten = with_driver_edits(spec, generated(root))
    assert rewritten["devices"] == spec["devices"]
    assert rewritten["containerEdits"] == common_edits(generated(root))
    assert rewritten["cdiVersion"] == spec["cdiVersion"]
    # The original is untouched: it still names the old files.
    assert [m["containerPath"] for m in spec["containerEdits"]["mounts"]] == old_files()


# -- the stage and settling -------------------------------------------------------------------


def test_prepares_are_refused_naming_both_versions_until_prepared_specs_name_the_new_files(
    node: Node, root: Path
) -> None:
    events = Events()
    settled: list[tuple[str, int]] = []
    change = change_for(node, root, events, on_settled=lambda r, n: settled.append((r, n)))
    running = node.table.add("running", device("gpu-0"))
    spec = prepared(node, running)
    assert mounted(spec) == old_files()
    newcomer = node.table.add("newcomer", device("gpu-3"))

    install(root, NEW)
    refused = change.around(PREPARE, [newcomer], node.preparer.prepare)
    error = refused[newcomer.uid].error
    assert f"changed from {OLD} to {NEW}" in error and "retry" in error
    assert error_reason(error) == "driver_change"
    assert node.store.get(newcomer.uid) is None  # nothing behind the stage ran
    # Unprepares only remove: they pass.
    assert change.around(UNPREPARE, [newcomer], node.preparer.unprepare)[newcomer.uid].error == ""

    followed: list[Mapping[str, Any]] = []
    change.on_edits = followed.append
    assert change.settle()
    assert mounted(spec) == new_files()  # a restarted container of the running pod
    assert followed == [generated(root)]  # MPS daemon pods started later follow too
    result = change.around(PREPARE, [newcomer], node.preparer.prepare)[newcomer.uid]
    assert result.error == ""
    assert mounted(node.preparer.spec_path(newcomer.uid)) == new_files()
    assert events.reasons == [CHANGED_REASON, REGENERATED_REASON]
    assert [t for _, _, t in events.seen] == ["Warning", "Normal"]
    assert NEW in events.seen[1][1] and "1 prepared claim spec(s) rewritten" in events.seen[1][1]
    assert settled == [("ok", 1)]
    assert change.settle() and settled == [("ok", 1)]  # nothing changed since: nothing to do


def test_a_spec_that_cannot_be_read_holds_no_other_prepare(node: Node, root: Path) -> None:
    events = Events()
    change = change_for(node, root, events)
    torn = prepared(node, node.table.add("torn", device("gpu-0")))
    good = prepared(node, node.table.add("good", device("gpu-3")))
    torn.write_text('{"kind": "gpu.flexgpu.dev/cl')
    install(root, NEW)
    assert change.settle()
    assert mounted(good) == new_files()
    assert torn.read_text() == '{"kind": "gpu.flexgpu.dev/cl'  # left as it is, not replaced
    ref = node.table.add("newcomer", device("gpu-4"))
    assert change.around(PREPARE, [ref], node.preparer.prepare)[ref.uid].error == ""
    assert "cannot be read, left as they are: uid-torn" in events.seen[-1][1]


def test_a_root_being_swapped_refuses_prepares_and_generates_nothing(
    node: Node, root: Path
) -> None:
    calls: list[int] = []
    change = DriverChange(
        root, read_fingerprint(root), node.preparer, lambda: calls.append(1) or generated(root)
    )
    (root / LIB_DIR / "libnvidia-ml.so.1").unlink()
    ref = node.table.add("c", device("gpu-0"))
    error = change.around(PREPARE, [ref], node.preparer.prepare)[ref.uid].error
    assert f"from {OLD} to none installed" in error
    assert not change.settle() and calls == []
    install(root, NEW)
    assert change.settle() and calls == [1]


def test_a_failing_generator_keeps_refusing_says_why_and_is_retried(node: Node, root: Path) -> None:
    events = Events()
    settled: list[tuple[str, int]] = []
    failures = [RuntimeError("flexgpu-cdi-common failed (exit 1): libcuda.so not found")]

    def generate() -> Mapping[str, Any]:
        if failures:
            raise failures.pop()
        return generated(root)

    change = DriverChange(
        root,
        read_fingerprint(root),
        node.preparer,
        generate,
        events=events,
        on_settled=lambda r, n: settled.append((r, n)),
    )
    spec = prepared(node, node.table.add("running", device("gpu-0")))
    install(root, NEW)
    assert not change.settle()
    ref = node.table.add("c", device("gpu-3"))
    error = change.around(PREPARE, [ref], node.preparer.prepare)[ref.uid].error
    assert "libcuda.so not found" in error
    assert mounted(spec) == old_files()
    assert change.settle()
    assert mounted(spec) == new_files()
    assert events.reasons == [CHANGED_REASON, FAILED_REASON, REGENERATED_REASON]
    assert settled == [("error", 0), ("ok", 1)]


def test_the_watch_settles_a_change_with_no_prepare_arriving(node: Node, root: Path) -> None:
    from flexgpu.kubelet_plugin.agents.driver_watch import DriverWatch

    change = change_for(node, root)
    spec = prepared(node, node.table.add("running", device("gpu-0")))
    watch = DriverWatch(change, poll_s=0.05)
    watch.start()
    try:
        install(root, NEW)
        wait_for(lambda: mounted(spec) == new_files(), timeout_s=10)
        wait_for(lambda: change.current == read_fingerprint(root), timeout_s=10)
    finally:
        watch.stop()


def test_the_refresh_runs_beside_prepares_and_unprepares_of_other_claims(
    node: Node, root: Path
) -> None:
    change = change_for(node, root)
    staying = [node.table.add(f"stay-{i}", device(f"gpu-{i}")) for i in (0, 3)]
    leaving = [node.table.add(f"leave-{i}", device(f"gpu-{i}")) for i in (4, 5)]
    # Past the stage before the change was seen: prepared while the refresh runs.
    arriving = [node.table.add(f"arrive-{i}", device(f"gpu-{i}")) for i in (6, 7)]
    for ref in staying + leaving:
        prepared(node, ref)
    install(root, NEW)
    errors: list[str] = []
    start = threading.Barrier(5)

    def run(call: Any) -> None:
        start.wait()
        for result in call().values():
            if result.error:
                errors.append(result.error)

    settled: list[bool] = []

    def settle() -> None:
        start.wait()
        settled.append(change.settle())

    threads = [threading.Thread(target=settle)]
    threads += [
        threading.Thread(target=run, args=(lambda r=r: node.preparer.unprepare([r]),))
        for r in leaving
    ]
    threads += [
        threading.Thread(target=run, args=(lambda r=r: node.preparer.prepare([r]),))
        for r in arriving
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and settled == [True]
    for ref in staying + arriving:
        assert mounted(node.preparer.spec_path(ref.uid)) == new_files(), ref.name
    for ref in leaving:
        assert not node.preparer.spec_path(ref.uid).exists()
        assert node.store.get(ref.uid) is None


def test_every_kind_of_prepared_claim_keeps_its_devices_and_sharing_through_a_refresh(
    node: Node, root: Path
) -> None:
    """Crossed with what a claim can hold: a whole GPU, a time-sliced GPU, an on-demand MIG
    partition with MPS, two fractions of a shared GPU (one claim, another namespace's claim
    cannot be beside them), a claim with a device on two GPUs."""
    refs = [
        node.table.add("whole", device("gpu-0")),
        node.table.add("sliced", device("gpu-3"), configs=(time_slicing(),)),
        node.table.add(
            "migmps",
            device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-0"),
            configs=(mig_mps(defaultActiveThreadPercentage=25),),
        ),
        node.table.add(
            "fractions",
            share(f"gpu-{SHARED_GPU}", "s-1", "8Gi"),
            share(f"gpu-{SHARED_GPU}", "s-2", "4Gi"),
        ),
        node.table.add("pair", device("gpu-4", "a"), device("gpu-5", "b")),
    ]
    specs = {ref.name: prepared(node, ref) for ref in refs}
    before = {name: json.loads(path.read_text()) for name, path in specs.items()}
    install(root, NEW)
    change = DriverChange(root, None, node.preparer, lambda: generated(root))
    assert change.settle()
    for name, path in specs.items():
        after = json.loads(path.read_text())
        assert after["devices"] == before[name]["devices"], name
        assert mounted(path) == new_files(), name
    # What the claims hold is still theirs to release: unprepare undoes it all.
    for ref in refs:
        assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert node.backend.list_mig_devices(DYNAMIC_GPU) == []
    assert not list((node.root / "cdi").glob("*.json"))


# -- SIGKILL in the refresh ------------------------------------------------------------------


def _settle_killed_at(node: Node, change: DriverChange, root: Path, step: str) -> None:
    """``change.settle()`` in a fresh plugin process that SIGKILLs itself at ``step``."""

    def child() -> None:
        preparer = ClaimPreparerImpl(
            node_name=NODE,
            claims=node.table,
            devices=NodeDevices(
                SimulatedBackend.from_topology(
                    "hgx-h100-8", NODE, state_path=node.data_dir / "simulated-gpus.json"
                ),
                shared={SHARED_GPU},
                dynamic_mig={DYNAMIC_GPU},
            ),
            store=CheckpointStore(node.data_dir / "checkpoint.json", node.root / "boot_id"),
            lock=PrepareLock(node.data_dir / "prepare.lock", timeout=20),
            cdi_dir=node.root / "cdi",
            crash_at=step,
        )
        preparer.driver_edits = node.preparer.driver_edits
        DriverChange(root, change.current, preparer, lambda: generated(root)).settle()
        os._exit(3)  # the step was never reached

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == -signal.SIGKILL, f"not killed at {step}"


@pytest.mark.parametrize("step", ["spec-refresh-before-write", "spec-refresh-written"])
def test_sigkill_in_the_refresh_leaves_whole_specs_and_the_next_start_finishes_it(
    node: Node, root: Path, step: str
) -> None:
    change = change_for(node, root)  # the old driver's fingerprint
    refs = [node.table.add(f"c{i}", device(f"gpu-{i}")) for i in (0, 3)]
    specs = [prepared(node, ref) for ref in refs]
    install(root, NEW)
    _settle_killed_at(node, change, root, step)

    # Killed mid-way: each spec is whole (it parses), the first new only once written.
    assert mounted(specs[0]) == (new_files() if step == "spec-refresh-written" else old_files())
    assert mounted(specs[1]) == old_files()

    # The next start generates the edits from the driver installed now and finishes the job.
    node.restart()
    node.preparer.driver_edits = generated(root)
    with node.lock:
        report = reconcile_at_start(node.preparer, node.store, node.table)
    assert sorted(report.kept) == ["ns/c0", "ns/c3"]
    restarted = DriverChange.at_start(
        root, read_fingerprint(root), node.preparer, lambda: generated(root)
    )
    assert restarted is not None and restarted.refusal() is None
    assert [mounted(spec) for spec in specs] == [new_files(), new_files()]
