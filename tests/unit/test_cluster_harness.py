"""The control-plane harness explains its failures: which component, and its last log lines;
a missing toolchain or bad KUBEBUILDER_ASSETS says what to do."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tools.cluster import ControlPlane, ControlPlaneError, binaries
from tools.cluster.feature_gates import feature_gates_arg


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


HELP = """      --feature-gates colonSeparatedMultimapStringString
                kube:DRAConsumableCapacity=true|false (BETA - default=true)
                kube:DRAPartitionableDevices=true|false (BETA - default=true)
                kube:SomethingElse=true|false (ALPHA - default=false)
"""


def test_feature_gates_only_name_gates_every_binary_accepts(tmp_path: Path) -> None:
    a = _script(tmp_path / "a", f"cat <<'E'\n{HELP}E\n")
    b = _script(
        tmp_path / "b",
        "cat <<'E'\n  kube:DRAConsumableCapacity=true|false (BETA - default=true)\nE\n",
    )
    assert feature_gates_arg([a]) == "DRAPartitionableDevices=true,DRAConsumableCapacity=true"
    # A gate one component does not list (GA-locked there, or removed) is left out for all.
    assert feature_gates_arg([a, b]) == "DRAConsumableCapacity=true"


def test_missing_go_toolchain_is_explained(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(binaries.BinariesError, match=r"Go toolchain .* KUBEBUILDER_ASSETS"):
        binaries.control_plane_dir()


def test_incomplete_kubebuilder_assets_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _script(tmp_path / "etcd", "exit 0\n")
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    with pytest.raises(binaries.BinariesError, match="lacks one of etcd, kube-apiserver"):
        binaries.control_plane_dir()


def test_old_kubebuilder_assets_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in binaries.CONTROL_PLANE:
        _script(tmp_path / name, 'echo "Kubernetes v1.30.4"\n')
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    with pytest.raises(binaries.BinariesError, match=r"1\.30; flexgpu needs 1\.34\+"):
        binaries.control_plane_dir()


def test_crashing_component_is_named_with_its_log_tail(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assets = tmp_path / "bin"
    assets.mkdir()
    # A stand-in etcd that serves /health, and an apiserver that dies at start.
    _script(
        assets / "etcd",
        'for a in "$@"; do case $a in --listen-client-urls=*) '
        "url=${a#*=};; esac; done\nport=${url##*:}\n"
        f'exec python3 -m http.server --bind 127.0.0.1 "$port" --directory {tmp_path}\n',
    )
    (tmp_path / "health").write_text("ok")
    _script(
        assets / "kube-apiserver",
        'case "$1" in --version) echo "Kubernetes v1.37.2";; '
        '--help) ;; *) echo "E0101 bad flag --etcd-servers: connection refused" >&2; '
        "exit 7;; esac\n",
    )
    for name in ("kube-scheduler", "kube-controller-manager"):
        _script(assets / name, "exit 0\n")
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    plane = ControlPlane(workdir=tmp_path / "cluster")
    with pytest.raises(ControlPlaneError) as failure:
        plane.start(timeout_s=20)
    message = str(failure.value)
    assert message.startswith("kube-apiserver exited with code 7")
    assert "bad flag --etcd-servers: connection refused" in message
    # Nothing is left running after a failed start.
    assert all(not c.running() for c in plane.components)
    assert os.path.exists(tmp_path / "cluster" / "logs" / "kube-apiserver.log")


def test_workloads_on_a_release_without_their_gates_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A control plane asked for gangs on binaries that do not list GenericWorkload and
    DRAWorkloadResourceClaims stops before starting anything, naming the missing gates."""
    assets = tmp_path / "bin"
    assets.mkdir()
    only_generic = "  kube:GenericWorkload=true|false (ALPHA - default=false)\n"
    for name in ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"):
        _script(
            assets / name,
            f'case "$1" in --version) echo "Kubernetes v1.37.2";; '
            f"--help) cat <<'E'\n{only_generic}E\n;; *) exit 0;; esac\n",
        )
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    plane = ControlPlane(workdir=tmp_path / "cluster", workloads=True)
    with pytest.raises(
        ControlPlaneError, match=r"gates DRAWorkloadResourceClaims, which Kubernetes v1\.37\.2 "
    ):
        plane.start(timeout_s=5)
    assert "GenericWorkload=true" in plane.feature_gates and plane.components == []
