"""Binding conditions on the real node (Kubernetes 1.37, the chart's defaults), where they meet
other features, checked from inside the containers:

- NVIDIA's MIG quickstart shape (an on-demand 1g.10gb partition with a ``MigDeviceConfig``,
  and the same with flexgpu's ``MigConfig``): the partition is made before binding, its
  ``PartitionReady`` written on a claim whose allocation carries opaque parameters, and the
  pod runs with that one MIG device;
- two namespaces asking fractions of free shared GPUs at the same instant: one namespace per
  GPU, the claim sent back (TenantTaken) is allocated on the other GPU and runs there.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from kubernetes import client

from flexgpu.controller.tenant_selector import tenant_expression
from tests.conftest import wait_for
from tests.node.conftest import DYNAMIC_MIG_GPUS, install_plugin
from tests.node.support import (
    DRIVER,
    create_claim,
    delete_pods,
    one_claim_pod,
    run_pod,
    wait_report,
)
from tools.node.node import RealNode

pytestmark = pytest.mark.integration

READY = f"{DRIVER}/PartitionReady"
# Two shared GPUs for the tenancy case (the session's chart shares gpu-5 only).
TWO_SHARED = "3\\,5"  # helm --set-string: a comma separates values unless escaped


def _mig_claim(kind: str) -> dict[str, Any]:
    is_small = f'device.attributes["{DRIVER}"].profile == "1g.10gb"'
    return {
        "requests": [
            {
                "name": "mig",
                "exactly": {
                    "deviceClassName": "mig.flexgpu.dev",
                    "selectors": [{"cel": {"expression": is_small}}],
                },
            }
        ],
        "config": [
            {
                "requests": ["mig"],
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {
                        "apiVersion": f"{DRIVER}/v1alpha1",
                        "kind": kind,
                        "sharing": {"strategy": "TimeSlicing"},
                    },
                },
            }
        ],
    }


@pytest.mark.parametrize("kind", ["MigDeviceConfig", "MigConfig"])
def test_a_mig_config_on_an_on_demand_partition_runs_with_binding_conditions(
    api: Any, namespace: str, plugin: RealNode, kind: str
) -> None:
    name = kind.lower()
    create_claim(api, namespace, name, _mig_claim(kind))
    run_pod(api, namespace, one_claim_pod(plugin, name, name))
    rep = wait_report(plugin, namespace, name)
    assert len(rep.visible_devices) == 1 and rep.visible_devices[0].startswith("MIG-")
    resources = client.ResourceV1Api(api)

    def prepared() -> Any:
        # Prepare's Ready goes out after the status writer's 1 s window.
        claim = resources.read_namespaced_resource_claim(name, namespace)
        (entry,) = claim.status.devices or [None]
        true = {c.type for c in (entry.conditions if entry else []) if c.status == "True"}
        return claim if {READY, "Ready"} <= true else None

    claim = wait_for(prepared, timeout_s=30, what="PartitionReady and Ready on the claim")
    (result,) = claim.status.allocation.devices.results
    assert result.device.startswith(f"gpu-{DYNAMIC_MIG_GPUS}-mig-1g10gb-")
    assert result.binding_conditions == [READY], "the chart's default on 1.37: on"
    (entry,) = claim.status.devices
    assert rep.visible_devices[0] in str(entry.data)
    delete_pods(api, namespace, name)


def test_two_namespaces_at_once_on_free_shared_gpus_run_on_different_gpus(
    api: Any, namespace: str, plugin: RealNode
) -> None:
    core = client.CoreV1Api(api)
    other = f"{namespace}-b"
    core.create_namespace({"metadata": {"name": other}})
    install_plugin(plugin, plugin.flexgpu_image, shared_gpus=TWO_SHARED)

    def share(ns: str) -> dict[str, Any]:
        # With the selector the controller's tenancy webhook adds (no controller runs here).
        return {
            "name": "gpu",
            "exactly": {
                "deviceClassName": "shared-gpu.flexgpu.dev",
                "capacity": {"requests": {"memory": "8Gi"}},
                "selectors": [{"cel": {"expression": tenant_expression(ns)}}],
            },
        }

    pods = [(ns, f"f{i}") for ns, i in itertools.product((namespace, other), range(2))]
    try:
        for ns, name in pods:
            create_claim(api, ns, name, {"requests": [share(ns)]})
        # Every pod at once: claims of both namespaces may reach the same free GPU.
        for ns, name in pods:
            core.create_namespaced_pod(ns, one_claim_pod(plugin, name, name))
        gpus: dict[str, set[str]] = {}
        for ns, name in pods:
            rep = wait_report(plugin, ns, name, timeout_s=180)
            gpus.setdefault(ns, set()).update(rep.visible_devices)
        assert len(gpus[namespace]) == len(gpus[other]) == 1, gpus
        assert gpus[namespace] != gpus[other], "one namespace per shared GPU"
        # Claims of both namespaces may be allocated to the same free GPU in one instant
        # (nothing decides a free GPU's tenant before binding): the later one is sent back
        # before binding (TenantTaken, the scheduler's PreBind) and runs on the other GPU, as
        # asserted above. What must never happen is a refusal at prepare, after binding.
        for ns, _ in pods:
            for event in core.list_namespaced_event(ns).items:
                if "another namespace" in (event.message or ""):
                    assert event.reason == "FailedScheduling", (event.reason, event.message)
                    assert "reason=TenantTaken" in event.message, event.message
    finally:
        for ns in (namespace, other):
            delete_pods(api, ns, *[name for n, name in pods if n == ns])
        core.delete_namespace(other)
        install_plugin(plugin, plugin.flexgpu_image)
