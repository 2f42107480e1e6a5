"""A rollback to the release before per-claim records (``helm rollback``) must not destroy what
running pods use: the plugin of that release, run from its own sources, finds the rollback
marker at ``checkpoint.json``, refuses it and exits before it deletes a CDI spec or a MIG
instance."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from flexgpu.driver.names import CDI_CLASS, CDI_VENDOR
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore, marker_bytes
from flexgpu.kubelet_plugin.claims.startup_reconcile import reconcile_at_start
from tests.unit.kubelet_plugin.prepare_support import ClaimTable, Node, device

REPO = Path(__file__).resolve().parents[3]
# The last commit whose plugin kept one checkpoint file for the node (schema version 1).
SCHEMA_1_RELEASE = "c9a8367"


@pytest.fixture(scope="module")
def schema_1_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """driver/ and kubelet_plugin/ as the schema-1 release had them."""
    run = subprocess.run(
        ["git", "-C", str(REPO), "archive", SCHEMA_1_RELEASE, "driver", "kubelet_plugin"],
        capture_output=True,
        check=False,
    )
    if run.returncode != 0:
        pytest.skip(f"commit {SCHEMA_1_RELEASE} is not in this clone: {run.stderr.decode()}")
    root = tmp_path_factory.mktemp("schema-1")
    with tarfile.open(fileobj=io.BytesIO(run.stdout)) as archive:
        archive.extractall(root, filter="data")
    return root


def _run_old(sources: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Run from the old tree: `-c` and `-m` put the working folder first on sys.path.
    env = {**os.environ, "PYTHONPATH": str(sources), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=sources,
        timeout=120,
        check=False,
    )


def test_a_fresh_start_writes_the_marker_and_the_old_load_path_refuses_it(
    tmp_path: Path, schema_1_sources: Path
) -> None:
    node = Node(tmp_path, ClaimTable())
    with node.lock:
        reconcile_at_start(node.preparer, node.store, node.table)
    assert node.store.legacy_path.read_bytes() == marker_bytes()

    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kubelet_plugin.checkpoint import CheckpointStore, UnsupportedCheckpointVersion\n"
        "try:\n"
        "    CheckpointStore(Path(sys.argv[1]), Path(sys.argv[2])).load()\n"
        "except UnsupportedCheckpointVersion as err:\n"
        "    print('refused:', err)\n"
        "    sys.exit(0)\n"
        "print('loaded')\n"
        "sys.exit(1)\n"
    )
    boot_file = node.store.boot_id_path
    result = _run_old(schema_1_sources, "-c", probe, str(node.store.legacy_path), str(boot_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "has schema version 2; this plugin reads up to 1" in result.stdout


def test_the_old_plugin_exits_at_start_and_leaves_specs_records_and_mig_instances(
    tmp_path: Path, schema_1_sources: Path
) -> None:
    data_dir, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    data_dir.mkdir()
    cdi_dir.mkdir()
    # What a running pod uses: a MIG instance on a dynamic-MIG GPU, its claim's CDI spec and
    # its record, as this release leaves them (marker included).
    backend = SimulatedBackend.from_topology(
        "h200-4", "node-a", state_path=data_dir / "simulated-gpus.json"
    )
    backend.set_mig_mode(0, True)
    profile = backend.mig_profiles(0)[0]
    instance = backend.create_mig_device(0, profile.profile_id, profile.placements[0])
    spec = cdi_dir / f"{CDI_VENDOR}-{CDI_CLASS}_0a1b2c3d-0000-4000-8000-000000000001.json"
    spec.write_text('{"cdiVersion": "0.5.0", "kind": "gpu.flexgpu.dev/claim", "devices": []}')
    store = CheckpointStore(data_dir / "checkpoint.json")
    record = store.claims_dir / "0a1b2c3d-0000-4000-8000-000000000001.json"
    record.parent.mkdir()
    record.write_bytes(b"{}")
    assert store.write_marker()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
    )

    result = _run_old(
        schema_1_sources,
        "-m",
        "kubelet_plugin.main",
        "--node-name=node-a",
        "--gpu-backend=simulated",
        "--topology=h200-4",
        "--dynamic-mig-gpus=0",
        f"--kubeconfig={kubeconfig}",
        f"--data-dir={data_dir}",
        f"--cdi-dir={cdi_dir}",
        f"--registry-dir={tmp_path / 'registry'}",
        f"--plugins-dir={tmp_path / 'plugins'}",
    )

    assert result.returncode != 0
    assert "UnsupportedCheckpointVersion" in result.stderr
    assert "has schema version 2; this plugin reads up to 1. It was left in place." in (
        result.stderr
    )
    assert spec.exists() and record.read_bytes() == b"{}"
    assert store.legacy_path.read_bytes() == marker_bytes()
    after = SimulatedBackend.from_topology(
        "h200-4", "node-a", state_path=data_dir / "simulated-gpus.json"
    )
    assert [i.uuid for i in after.list_mig_devices(0)] == [instance.uuid]


def test_marker_is_not_migrated_nor_reported(tmp_path: Path) -> None:
    node = Node(tmp_path, ClaimTable())
    ref = node.table.add("whole", device("gpu-0"))
    assert not node.preparer.prepare([ref])[ref.uid].error
    with node.lock:
        first = reconcile_at_start(node.preparer, node.store, node.table)
    node.restart()
    events: list[tuple[str, str]] = []
    with node.lock:
        second = reconcile_at_start(
            node.preparer, node.store, node.table, lambda r, m: events.append((r, m))
        )
    assert (first.checkpoint_status, second.checkpoint_status) == ("current", "current")
    assert events == [] and second.kept == ["ns/whole"]
    assert node.store.scan().legacy_status == "marker"
    assert not node.store.legacy_changed()  # serving does not rescan because of the marker
