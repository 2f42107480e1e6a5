"""An in-place driver upgrade on the real node, as NVIDIA's GPU Operator does one: the
simulated driver's version is swapped under a running GPU pod. The pod keeps running with the
files it was given; a pod started afterwards gets the new driver's files (checked from inside
its container); the running pod's CDI spec names them too, for a restarted container; the
Node carries the plugin's Events."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.node.conftest import NODE
from tests.node.support import claim_uid, delete_pods, wait_report
from tests.node.test_real_node_faults import container_id, last_seq, start_gpu_pod
from tools.node import driver_root
from tools.node.node import RealNode

pytestmark = pytest.mark.integration

NEW = "590.44.01"


def libraries(files: list[str], version: str) -> list[str]:
    return sorted(f for f in files if f.endswith(f".so.{version}"))


def spec_mounts(node: RealNode, uid: str) -> list[str]:
    (spec,) = node.layout.cdi_dir.glob(f"*{uid}*.json")
    edits = json.loads(spec.read_text())["containerEdits"]
    return [str(m["containerPath"]) for m in edits.get("mounts", [])]


def node_events(api: Any, reason: str) -> list[str]:
    events = client.CoreV1Api(api).list_namespaced_event(
        "default", field_selector=f"involvedObject.name={NODE},reason={reason}"
    )
    return [str(e.message) for e in events.items]


def test_a_driver_swapped_under_a_running_pod_reaches_the_next_pod(
    api: Any, namespace: str, plugin: RealNode
) -> None:
    driver = plugin.driver
    assert driver is not None
    old = driver_root.installed_version(driver)
    running = start_gpu_pod(api, namespace, plugin, "before")
    assert libraries(running.files, old), running.files
    cid = container_id(api, namespace, "before")
    running_uid = claim_uid(api, namespace, "before")

    driver_root.install_version(driver, NEW)
    try:
        # The kubelet retries the prepare the plugin refuses until its specs follow the driver.
        fresh = start_gpu_pod(api, namespace, plugin, "after")
        assert libraries(fresh.files, NEW), fresh.files
        assert libraries(fresh.files, old) == [], fresh.files

        # The running pod kept its container and the files it started with ...
        kept = wait_report(plugin, namespace, "before", after=last_seq(plugin, namespace, "before"))
        assert container_id(api, namespace, "before") == cid
        assert kept.visible_devices == running.visible_devices
        assert libraries(kept.files, old), kept.files
        # ... and a restart of it would be handed the new ones.
        mounts = spec_mounts(plugin, running_uid)
        assert any(m.endswith(f".so.{NEW}") for m in mounts), mounts
        assert not any(m.endswith(f".so.{old}") for m in mounts), mounts
        changed = node_events(api, "DriverChanged")
        assert any(f"from {old} to {NEW}" in m for m in changed), changed
        wait_for(
            lambda: any(NEW in m for m in node_events(api, "DriverSpecsRegenerated")),
            what="the plugin's Event that specs follow the new driver",
        )
    finally:
        delete_pods(api, namespace, "before", "after")
        # Back where the other tests expect it, and the plugin's specs with it.
        back = f"follow NVIDIA driver {old} ("
        seen = sum(back in m for m in node_events(api, "DriverSpecsRegenerated"))
        driver_root.install_version(driver, old)
        wait_for(
            lambda: sum(back in m for m in node_events(api, "DriverSpecsRegenerated")) > seen,
            timeout_s=60,
            what=f"the plugin back on driver {old}",
        )
