"""Shared fixtures: a session-wide real control plane (started only when a test asks for
it) and a fresh namespace per test."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.cluster import ControlPlane


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
    predicate: Any, timeout_s: float = 30.0, interval_s: float = 0.1, what: str = "condition"
) -> Any:
    """Polls until predicate() returns something truthy; fails the test with `what`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")
