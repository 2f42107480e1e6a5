"""Shared fixtures: a session-wide real control plane (started only when a test asks for
it) and a fresh namespace per test. Also the Kubernetes release a run targets (FLEXGPU_K8S,
``make test K8S=1.34``): ``@pytest.mark.requires_k8s("1.35", why)`` skips a test of a
feature an older release lacks, and every such skip is listed with its reason at the end."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.cluster import ControlPlane, binaries

# (test id, reason) of each test skipped because this run's release lacks what it tests.
_RELEASE_SKIPS: list[tuple[str, str]] = []
_MINOR: list[int] = []


def put_fetched_go_first() -> None:
    """pytest run directly, not through make, finds the Go toolchain tools/go-toolchain.sh
    fetched where the machine's go is missing or too old: first on PATH, as the Makefile puts
    it (the builds the tests start need it)."""
    cache = os.environ.get("FLEXGPU_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flexgpu"
    )
    bin_dir = str(Path(cache) / "go" / "bin")
    path = os.environ.get("PATH", "")
    if Path(bin_dir, "go").exists() and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir


def pytest_configure(config: pytest.Config) -> None:
    put_fetched_go_first()
    config.addinivalue_line(
        "markers",
        "requires_k8s(release, why): skipped, with why printed, on releases older than release",
    )
    config.addinivalue_line(
        "markers",
        "core: the core end-to-end set (whole GPU, NVLink, dynamic MIG, fractions, node policy, "
        "chart install) that CI also runs on the oldest supported release",
    )


def target_minor() -> int:
    """The Kubernetes minor version this run's control plane is (cached; builds nothing)."""
    if not _MINOR:
        _MINOR.append(binaries.expected_minor())
    return _MINOR[0]


def require_k8s(release: str, why: str, nodeid: str = "") -> None:
    """Skips the calling test, naming the release and why, unless the run targets ``release``
    ("1.35") or newer; the skip is also listed in the run's summary."""
    minor = int(release.removeprefix("v").split(".")[1])
    have = target_minor()
    if have < minor:
        reason = f"needs Kubernetes {release}+ ({why}); this run targets 1.{have}"
        current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        _RELEASE_SKIPS.append((nodeid or current, reason))
        pytest.skip(reason)


def pytest_report_header(config: pytest.Config) -> str:
    chosen = os.environ.get(binaries.RELEASE_ENV)
    how = f"{binaries.RELEASE_ENV}={chosen}" if chosen else "the default release"
    try:
        return f"kubernetes: 1.{target_minor()} ({how})"
    except binaries.BinariesError as exc:
        return f"kubernetes: unknown ({exc})"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("requires_k8s")
    if marker is not None:
        release = marker.args[0]
        why = marker.kwargs.get("why") or (marker.args[1] if len(marker.args) > 1 else "")
        if not why:
            raise pytest.UsageError(f"{item.nodeid}: requires_k8s({release!r}) needs a why")
        require_k8s(release, why, item.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _RELEASE_SKIPS:
        terminalreporter.section(
            f"skipped on Kubernetes 1.{target_minor()}: {len(_RELEASE_SKIPS)} tests"
        )
        for nodeid, reason in _RELEASE_SKIPS:
            terminalreporter.write_line(f"{nodeid}: {reason}")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    # FLEXGPU_TEST_CLUSTER_DIR keeps the cluster's logs and data somewhere to inspect later.
    chosen = os.environ.get("FLEXGPU_TEST_CLUSTER_DIR")
    workdir = Path(chosen) if chosen else tmp_path_factory.mktemp("cluster")
    plane = ControlPlane(workdir=workdir)
    plane.start()
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def api(cluster: ControlPlane) -> Any:
    return cluster.api_client()


@pytest.fixture
def namespace(api: Any) -> Iterator[str]:
    from kubernetes import client

    core = client.CoreV1Api(api)
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    # Pods are admitted only once the serviceaccount controller made the default account.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            core.read_namespaced_service_account("default", name)
            break
        except client.ApiException:
            time.sleep(0.1)
    else:
        pytest.fail(f"no default ServiceAccount in namespace {name} after 30s")
    yield name
    core.delete_namespace(name)


def wait_for(
    predicate: Any,
    timeout_s: float = 30.0,
    interval_s: float = 0.1,
    what: str = "condition",
    explain: Any = None,
) -> Any:
    """Polls until predicate() returns something truthy; fails the test with `what` (and,
    with ``explain``, what it returns then: the state a failure needs to be understood)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    detail = f"\n{explain()}" if explain is not None else ""
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r}){detail}")


def holds_for(predicate: Any, seconds: float, why: str, interval_s: float = 0.2) -> None:
    """For properties about nothing happening: predicate() must stay truthy for ``seconds``
    (checked every ``interval_s``; fails at the first falsy answer). ``why`` says what bounds
    the window (e.g. how many passes of the component it covers), and goes into the failure."""
    deadline = time.monotonic() + seconds
    while True:
        if not predicate():
            pytest.fail(f"stopped holding within {seconds:g}s ({why})")
        if time.monotonic() >= deadline:
            return
        time.sleep(interval_s)
