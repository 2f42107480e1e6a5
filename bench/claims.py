"""ResourceClaims allocated to one device each, written as the scheduler would write them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client


@dataclass(frozen=True)
class BenchClaim:
    namespace: str
    name: str
    uid: str
    device: int  # index of the GPU it is allocated ("gpu-<device>")


def allocated_claims(
    api: Any,
    namespace: str,
    *,
    prefix: str,
    driver: str,
    device_class: str,
    pool: str,
    devices: int,
    per_device: int,
    device_name: Callable[[int], str] = lambda gpu: f"gpu-{gpu}",
) -> list[BenchClaim]:
    """`devices * per_device` claims; claim i is allocated device `device_name(i % devices)`
    (default `gpu-<i % devices>`) of `driver` in `pool` (the node's name), with the node
    selector the scheduler would set."""
    resource: Any = client.ResourceV1Api(api)
    claims = []
    for i in range(devices * per_device):
        name = f"{prefix}-{i}"
        created: Any = resource.create_namespaced_resource_claim(
            namespace,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]
                    }
                },
            },
        )
        body = client.ApiClient().sanitize_for_serialization(created)
        device = i % devices
        body["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": driver,
                            "pool": pool,
                            "device": device_name(device),
                        }
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [pool]}
                            ]
                        }
                    ]
                },
            }
        }
        resource.replace_namespaced_resource_claim_status(name, namespace, body)
        claims.append(BenchClaim(namespace, name, created.metadata.uid, device))
    return claims
