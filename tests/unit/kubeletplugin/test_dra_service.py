"""DRAService without sockets: request/response mapping and failure containment."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc
import pytest

from flexgpu.kubelet_plugin.kubeletplugin import (
    ClaimRef,
    PreparedDevice,
    PrepareResult,
    UnprepareResult,
)
from flexgpu.kubelet_plugin.kubeletplugin.dra_service import MISSING_RESULT, DRAService, _as_v1beta1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2 as v1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1beta1 import dra_pb2 as v1beta1
from tests.unit.kubeletplugin.fakes import MemoryPreparer


def _claim(name: str, uid: str | None = None) -> v1.Claim:
    return v1.Claim(namespace="ns", name=name, uid=uid or f"uid-{name}")


def test_prepare_maps_devices_and_share_id() -> None:
    preparer = MemoryPreparer()
    response = DRAService(preparer).node_prepare_resources(
        v1.NodePrepareResourcesRequest(claims=[_claim("a"), _claim("shared-b")])
    )
    assert set(response.claims) == {"uid-a", "uid-shared-b"}
    (device,) = response.claims["uid-a"].devices
    assert (device.pool_name, device.device_name) == ("node-a", "gpu-a")
    assert list(device.cdi_device_ids) == ["k8s.gpu.flexgpu.dev/claim=uid-a"]
    assert list(device.request_names) == ["gpu"]
    assert not device.HasField("share_id")
    assert response.claims["uid-shared-b"].devices[0].share_id == "share-uid-shared-b"
    assert preparer.prepared["uid-a"] == ClaimRef("ns", "a", "uid-a")


def test_empty_request_succeeds_without_calling_the_preparer() -> None:
    preparer = MemoryPreparer()
    service = DRAService(preparer)
    assert service.node_prepare_resources(v1.NodePrepareResourcesRequest()) == (
        v1.NodePrepareResourcesResponse()
    )
    assert service.node_unprepare_resources(v1.NodeUnprepareResourcesRequest()) == (
        v1.NodeUnprepareResourcesResponse()
    )
    assert preparer.calls == []


def test_duplicate_claims_are_passed_once() -> None:
    preparer = MemoryPreparer()
    DRAService(preparer).node_prepare_resources(
        v1.NodePrepareResourcesRequest(claims=[_claim("a"), _claim("a"), _claim("b")])
    )
    assert preparer.calls == [("prepare", ["uid-a", "uid-b"])]


def test_preparer_exception_becomes_an_error_for_every_claim() -> None:
    preparer = MemoryPreparer()
    preparer.fail_with = grpc.RpcError("backend unavailable")
    service = DRAService(preparer)
    request = v1.NodePrepareResourcesRequest(claims=[_claim("a"), _claim("b")])
    response = service.node_prepare_resources(request)
    assert {uid: r.error for uid, r in response.claims.items()} == {
        "uid-a": "prepare failed: backend unavailable",
        "uid-b": "prepare failed: backend unavailable",
    }
    unprepared = service.node_unprepare_resources(
        v1.NodeUnprepareResourcesRequest(claims=request.claims)
    )
    assert unprepared.claims["uid-a"].error == "unprepare failed: backend unavailable"


class _Partial:
    """Answers for some claims only, and one answer is malformed."""

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        bad = PreparedDevice(pool_name="p", device_name=42)  # type: ignore[arg-type]
        return {
            "uid-ok": PrepareResult(devices=(PreparedDevice("p", "d"),)),
            "uid-bad": PrepareResult(devices=(bad,)),
            "uid-failed": PrepareResult.failed("no such GPU"),
            "uid-not-asked": PrepareResult(),
        }

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]:
        return {"uid-ok": UnprepareResult()}


def test_every_requested_claim_gets_an_entry() -> None:
    service = DRAService(_Partial())
    names = ["ok", "bad", "failed", "forgotten"]
    response = service.node_prepare_resources(
        v1.NodePrepareResourcesRequest(claims=[_claim(n) for n in names])
    )
    assert sorted(response.claims) == sorted(f"uid-{n}" for n in names)
    assert response.claims["uid-ok"].error == ""
    assert response.claims["uid-bad"].error.startswith("prepare returned an invalid result")
    assert not response.claims["uid-bad"].devices
    assert response.claims["uid-failed"].error == "no such GPU"
    assert response.claims["uid-forgotten"].error == MISSING_RESULT

    unprepared = service.node_unprepare_resources(
        v1.NodeUnprepareResourcesRequest(claims=[_claim("ok"), _claim("other")])
    )
    assert unprepared.claims["uid-ok"].error == ""
    assert unprepared.claims["uid-other"].error == MISSING_RESULT


def test_v1beta1_serialiser_drops_share_id_only() -> None:
    response = v1.NodePrepareResourcesResponse()
    entry = response.claims["u"]
    entry.devices.add(pool_name="p", device_name="d", cdi_device_ids=["x=y"], share_id="s1")
    data = _as_v1beta1(v1beta1.NodePrepareResourcesResponse)(response)
    parsed = v1beta1.NodePrepareResourcesResponse.FromString(data)
    assert parsed.claims["u"].devices[0].device_name == "d"
    assert list(parsed.claims["u"].devices[0].cdi_device_ids) == ["x=y"]
    # Nothing of share_id (field 5) is left on the wire for a v1beta1 kubelet.
    assert v1.NodePrepareResourcesResponse.FromString(data).claims["u"].devices[0].share_id == ""


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        (
            v1.Claim(namespace="ns", name="", uid="u1"),
            "claim name: empty; allowed: a ResourceClaim",
        ),
        (v1.Claim(namespace="", name="a", uid="u1"), "claim namespace: empty; allowed: a namesp"),
        (v1.Claim(namespace="ns", name="a", uid=""), "claim uid: empty; allowed: a ResourceClaim"),
        (v1.Claim(namespace="ns", name="A/b", uid="u1"), "claim name: 'A/b' is not allowed"),
        (v1.Claim(namespace="n" * 64, name="a", uid="u1"), "claim namespace: 'nnn"),
    ],
)
def test_malformed_claims_are_refused_by_field_and_never_reach_the_preparer(
    claim: v1.Claim, message: str
) -> None:
    preparer = MemoryPreparer()
    service = DRAService(preparer)
    good = _claim("ok")
    prepared = service.node_prepare_resources(v1.NodePrepareResourcesRequest(claims=[claim, good]))
    assert prepared.claims[claim.uid].error.startswith(message)
    assert not prepared.claims[claim.uid].devices
    assert prepared.claims["uid-ok"].error == ""
    unprepared = service.node_unprepare_resources(v1.NodeUnprepareResourcesRequest(claims=[claim]))
    assert unprepared.claims[claim.uid].error.startswith(message)
    assert preparer.calls == [("prepare", ["uid-ok"])]


def test_a_huge_claim_name_is_echoed_shortened_with_its_length() -> None:
    name = "a" * 1_000_000
    response = DRAService(MemoryPreparer()).node_prepare_resources(
        v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace="ns", name=name, uid="u1")])
    )
    error = response.claims["u1"].error
    assert error.startswith("claim name: 'aaaa") and "(1000002 characters)" in error
    assert len(error) < 300
