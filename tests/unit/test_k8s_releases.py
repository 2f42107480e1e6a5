"""Release selection: FLEXGPU_K8S names a release tools/k8s can build (anything else is
refused with the allowed list), KUBEBUILDER_ASSETS must agree with it, and a test marked
for a newer release is skipped with the release and the reason."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests import conftest
from tools.cluster import binaries
from tools.cluster.feature_gates import describe, runtime_config_arg


def test_default_release_is_the_one_tools_k8s_go_mod_pins() -> None:
    pinned = [
        line.split()[1]
        for line in binaries.DEFAULT_MODULE.read_text().splitlines()
        if line.strip().startswith("k8s.io/kubernetes v")
    ]
    assert binaries.default_release() == ".".join(pinned[0].lstrip("v").split(".")[:2])


def test_every_pinned_release_is_buildable_oldest_first() -> None:
    releases = binaries.buildable_releases()
    assert releases[0] == "1.34"
    assert releases[-1] == binaries.default_release()
    assert [int(r.split(".")[1]) for r in releases] == sorted(int(r[2:]) for r in releases)


@pytest.mark.parametrize("raw", ["1.34", "v1.34", "1.34.12", " 1.34 "])
def test_release_spellings_select_the_minor(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(binaries.RELEASE_ENV, raw)
    assert binaries.selected_release() == "1.34"
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    assert binaries.expected_minor() == 34


@pytest.mark.parametrize("raw", ["1.33", "2.0", "latest", "1.99"])
def test_unknown_release_is_refused_with_the_allowed_ones(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(binaries.RELEASE_ENV, raw)
    with pytest.raises(
        binaries.BinariesError, match=r"not a release tools/k8s builds; allowed: 1\.34"
    ):
        binaries.selected_release()


def test_assets_of_another_release_than_selected_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in binaries.CONTROL_PLANE:
        path = tmp_path / name
        path.write_text('#!/bin/sh\necho "Kubernetes v1.37.2"\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    monkeypatch.setenv(binaries.RELEASE_ENV, "1.34")
    with pytest.raises(
        binaries.BinariesError, match=r"holds kube-apiserver 1\.37 but FLEXGPU_K8S=1\.34"
    ):
        binaries.control_plane_dir()


def test_require_k8s_skips_older_releases_naming_release_and_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(conftest, "_MINOR", [34])
    monkeypatch.setattr(conftest, "_RELEASE_SKIPS", [])
    with pytest.raises(pytest.skip.Exception) as skipped:
        conftest.require_k8s("1.35", "shared counters in their own slices", "t::x")
    assert str(skipped.value) == (
        "needs Kubernetes 1.35+ (shared counters in their own slices); this run targets 1.34"
    )
    recorded = conftest._RELEASE_SKIPS
    assert recorded == [("t::x", str(skipped.value))]
    # The same release or a newer one runs the test.
    conftest.require_k8s("1.34", "anything", "t::y")
    monkeypatch.setattr(conftest, "_MINOR", [37])
    conftest.require_k8s("1.35", "anything", "t::z")
    assert len(conftest._RELEASE_SKIPS) == 1


def test_gate_description_names_stage_default_or_not_settable(tmp_path: Path) -> None:
    apiserver = tmp_path / "kube-apiserver"
    apiserver.write_text(
        "#!/bin/sh\ncat <<'E'\n"
        "                kube:DRAConsumableCapacity=true|false (ALPHA - default=false)\n"
        "                kube:ResourceHealthStatus=true|false (BETA - default=true)\n"
        "E\n"
    )
    apiserver.chmod(apiserver.stat().st_mode | stat.S_IXUSR)
    assert describe(
        tmp_path, ("DRAConsumableCapacity", "ResourceHealthStatus", "DRAAdminAccess")
    ) == [
        "DRAConsumableCapacity: ALPHA (default false)",
        "ResourceHealthStatus: BETA (default true)",
        "DRAAdminAccess: not settable (default -)",
    ]


@pytest.mark.parametrize(
    ("gates", "minor", "expected"),
    [
        ("DRADeviceTaints=true,DRAConsumableCapacity=true", 34, "resource.k8s.io/v1alpha3=true"),
        ("DRADeviceTaintRules=true", 35, "resource.k8s.io/v1alpha3=true"),
        ("DRADeviceTaints=true,DRADeviceTaintRules=true", 36, "resource.k8s.io/v1beta2=true"),
        # GA on 1.37: the gates are not settable there, and v1 is served anyway.
        ("DRAPartitionableDevices=true", 37, ""),
        # A gate left off needs no API version.
        ("DRAConsumableCapacity=true", 34, ""),
        # Gangs: the scheduler and the resourceclaim controller read PodGroups in these.
        (
            "GenericWorkload=true,DRAWorkloadResourceClaims=true",
            37,
            "scheduling.k8s.io/v1beta1=true",
        ),
        (
            "DRADeviceTaintRules=true,GenericWorkload=true",
            36,
            "resource.k8s.io/v1beta2=true,scheduling.k8s.io/v1alpha2=true",
        ),
        ("GenericWorkload=false", 37, ""),
    ],
)
def test_gated_api_is_served_where_the_enabled_gate_makes_components_watch_it(
    gates: str, minor: int, expected: str
) -> None:
    assert runtime_config_arg(gates, minor) == expected
