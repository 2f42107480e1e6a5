"""The DRAPlugin gRPC service (v1 and v1beta1 from one implementation).

Turns kubelet requests into ClaimRef batches for the DraDriver and its results back into
responses. Whatever the preparer does, every claim of the request gets an entry: failures
become per-claim errors, because a gRPC error would make the kubelet drop the whole batch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

import grpc

from flexgpu.kubelet_plugin.kubeletplugin import grpc_handlers as h
from flexgpu.kubelet_plugin.kubeletplugin.claims import (
    ClaimRef,
    DraDriver,
    PreparedDevice,
    PrepareResult,
    UnprepareResult,
)
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2 as v1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1beta1 import dra_pb2 as v1beta1

log = logging.getLogger(__name__)

MISSING_RESULT = "the driver returned no result for this claim"
# Long enough for any valid Kubernetes name (253) to stay recognisable from its start.
ECHO_LIMIT = 100


def shorten(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text``, cut to ``limit`` characters plus its length when longer: a malformed request
    can carry megabytes that must not reach logs or gRPC statuses whole. (The GPU driver's own
    copy is driver.user_text; this package stays free of driver imports.)"""
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# What the kubelet can send for a real claim: the apiserver's own rules for the names.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_NAMESPACE = re.compile(_DNS_LABEL)
_NAME = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_UID = re.compile(r"[0-9A-Za-z-]+")
# (field, pattern, most characters, what is allowed)
_CLAIM_FIELDS: tuple[tuple[str, re.Pattern[str], int, str], ...] = (
    ("namespace", _NAMESPACE, 63, "a namespace name (a DNS label of 1-63 characters)"),
    ("name", _NAME, 253, "a ResourceClaim name (a DNS subdomain of 1-253 characters)"),
    ("uid", _UID, 128, "a ResourceClaim UID (1-128 letters, digits and dashes)"),
)


def claim_problem(claim: v1.Claim) -> str:
    """Why the kubelet's ``claim`` cannot name a ResourceClaim, or ``""`` when it can. The
    text names the field, shows the value (shortened) and what is allowed; nothing about the
    claim is looked up or prepared when it is refused here."""
    for field, pattern, most, allowed in _CLAIM_FIELDS:
        value: str = getattr(claim, field)
        if not value:
            return f"claim {field}: empty; allowed: {allowed}"
        if len(value) > most or not pattern.fullmatch(value):
            return f"claim {field}: {shorten(repr(value))} is not allowed; allowed: {allowed}"
    return ""


def claim_refs(claims: Iterable[v1.Claim]) -> list[ClaimRef]:
    """Request claims as ClaimRefs, first occurrence of each UID only."""
    unique: dict[str, ClaimRef] = {}
    for claim in claims:
        unique.setdefault(claim.uid, ClaimRef(claim.namespace, claim.name, claim.uid))
    return list(unique.values())


def _split(claims: Iterable[v1.Claim]) -> tuple[list[ClaimRef], dict[str, str]]:
    """The well-formed claims (first occurrence of each UID), and the refusal of each
    malformed one keyed by its UID as sent (the response map's key)."""
    refused: dict[str, str] = {}
    good: list[v1.Claim] = []
    for claim in claims:
        problem = claim_problem(claim)
        if problem:
            refused.setdefault(claim.uid, problem)
        else:
            good.append(claim)
    return [ref for ref in claim_refs(good) if ref.uid not in refused], refused


def _device_message(device: PreparedDevice) -> v1.Device:
    message = v1.Device(
        request_names=list(device.request_names),
        pool_name=device.pool_name,
        device_name=device.device_name,
        cdi_device_ids=list(device.cdi_device_ids),
    )
    if device.share_id is not None:
        message.share_id = device.share_id
    return message


def _describe(claim: ClaimRef) -> str:
    return shorten(f"{claim.namespace}/{claim.name} ({claim.uid})")


class DRAService:
    """Implements k8s.io.kubelet.pkg.apis.dra.{v1,v1beta1}.DRAPlugin over a DraDriver."""

    def __init__(self, preparer: DraDriver) -> None:
        self.preparer = preparer

    def node_prepare_resources(
        self, request: v1.NodePrepareResourcesRequest
    ) -> v1.NodePrepareResourcesResponse:
        claims, refused = _split(request.claims)
        response = v1.NodePrepareResourcesResponse()
        for uid, problem in refused.items():
            log.warning("prepare refused: %s", problem)
            response.claims[uid].error = problem
        if not claims:  # liveness probes send an empty request
            return response
        results: Mapping[str, PrepareResult]
        try:
            results = self.preparer.prepare(claims)
        except Exception as exc:
            log.exception("prepare of %d claim(s) failed", len(claims))
            results = {c.uid: PrepareResult.failed(f"prepare failed: {exc}") for c in claims}
        for claim in claims:
            entry = response.claims[claim.uid]
            result = results.get(claim.uid) or PrepareResult.failed(MISSING_RESULT)
            try:
                if result.error:
                    entry.error = result.error
                else:
                    entry.devices.extend(_device_message(d) for d in result.devices)
            except Exception as exc:  # a malformed result must not take the batch down
                log.exception("bad prepare result for claim %s", _describe(claim))
                entry.Clear()
                entry.error = f"prepare returned an invalid result: {exc}"
            if entry.error:
                log.warning("prepare of claim %s failed: %s", _describe(claim), entry.error)
        return response

    def node_unprepare_resources(
        self, request: v1.NodeUnprepareResourcesRequest
    ) -> v1.NodeUnprepareResourcesResponse:
        claims, refused = _split(request.claims)
        response = v1.NodeUnprepareResourcesResponse()
        for uid, problem in refused.items():
            log.warning("unprepare refused: %s", problem)
            response.claims[uid].error = problem
        if not claims:
            return response
        results: Mapping[str, UnprepareResult]
        try:
            results = self.preparer.unprepare(claims)
        except Exception as exc:
            log.exception("unprepare of %d claim(s) failed", len(claims))
            results = {c.uid: UnprepareResult(f"unprepare failed: {exc}") for c in claims}
        for claim in claims:
            entry = response.claims[claim.uid]
            result = results.get(claim.uid) or UnprepareResult(MISSING_RESULT)
            try:
                entry.error = result.error
            except Exception as exc:
                log.exception("bad unprepare result for claim %s", _describe(claim))
                entry.error = f"unprepare returned an invalid result: {exc}"
            if entry.error:
                log.warning("unprepare of claim %s failed: %s", _describe(claim), entry.error)
        return response

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        # v1beta1 requests are byte-for-byte v1 requests, so both versions parse into v1.
        prepare, unprepare = self.node_prepare_resources, self.node_unprepare_resources
        parse_prepare = v1.NodePrepareResourcesRequest.FromString
        parse_unprepare = v1.NodeUnprepareResourcesRequest.FromString
        v1_methods = {
            "NodePrepareResources": h.unary(prepare, parse_prepare),
            "NodeUnprepareResources": h.unary(unprepare, parse_unprepare),
        }
        v1beta1_methods = {
            "NodePrepareResources": h.unary(
                prepare, parse_prepare, _as_v1beta1(v1beta1.NodePrepareResourcesResponse)
            ),
            "NodeUnprepareResources": h.unary(
                unprepare, parse_unprepare, _as_v1beta1(v1beta1.NodeUnprepareResourcesResponse)
            ),
        }
        return [
            h.service(h.service_name(v1.DESCRIPTOR, "DRAPlugin"), v1_methods),
            h.service(h.service_name(v1beta1.DESCRIPTOR, "DRAPlugin"), v1beta1_methods),
        ]


def _as_v1beta1(message_type: Any) -> h.Serializer:
    """Serialiser of a v1 response as its v1beta1 twin, dropping what v1beta1 lacks (share_id)."""

    def serialize(response: Any) -> bytes:
        converted = message_type.FromString(response.SerializeToString())
        converted.DiscardUnknownFields()
        data: bytes = converted.SerializeToString()
        return data

    return serialize
