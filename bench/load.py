"""Prepare+unprepare cycles on a plugin's DRA socket, made as the kubelet makes them: one
claim per NodePrepareResources/NodeUnprepareResources v1 call, from one or more callers at
once over one connection. A failed call is counted, never raised."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from bench.claims import BenchClaim
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra.v1 import dra_pb2_grpc

# The kubelet gives a DRA call a few tens of seconds; past this the call counts as failed.
CALL_TIMEOUT_S = 10.0


@dataclass
class LoadResult:
    prepare_ms: list[float] = field(default_factory=list)
    unprepare_ms: list[float] = field(default_factory=list)
    cycles_ok: int = 0
    cycles: int = 0
    failed_calls: int = 0
    elapsed_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few, for the explanation

    def add(self, other: LoadResult) -> None:
        self.prepare_ms += other.prepare_ms
        self.unprepare_ms += other.unprepare_ms
        self.cycles_ok += other.cycles_ok
        self.cycles += other.cycles
        self.failed_calls += other.failed_calls
        self.elapsed_s += other.elapsed_s
        self.errors += other.errors[: max(0, 5 - len(self.errors))]

    @property
    def cycles_per_s(self) -> float:
        return self.cycles_ok / self.elapsed_s if self.cycles else math.nan


def _call_error(reply_error: str | None, exc: grpc.RpcError | None) -> str | None:
    if exc is not None:
        return f"{exc.code().name}: {exc.details()}"
    return reply_error or None


def _cycle(stub: dra_pb2_grpc.DRAPluginStub, claim: BenchClaim, out: LoadResult) -> None:
    ref = dra_pb2.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)
    failures: list[str] = []
    t0 = time.perf_counter()
    try:
        prepared = stub.NodePrepareResources(
            dra_pb2.NodePrepareResourcesRequest(claims=[ref]), timeout=CALL_TIMEOUT_S
        )
        entry = prepared.claims.get(claim.uid)
        err = _call_error("no result for the claim" if entry is None else entry.error, None)
    except grpc.RpcError as exc:
        err = _call_error(None, exc)
    t1 = time.perf_counter()
    if err:
        failures.append(f"prepare: {err}")
    # The kubelet unprepares a pod's claims when the pod goes away, whether or not their
    # prepare succeeded.
    try:
        unprepared = stub.NodeUnprepareResources(
            dra_pb2.NodeUnprepareResourcesRequest(claims=[ref]), timeout=CALL_TIMEOUT_S
        )
        u_entry = unprepared.claims.get(claim.uid)
        u_err = _call_error("no result for the claim" if u_entry is None else u_entry.error, None)
    except grpc.RpcError as exc:
        u_err = _call_error(None, exc)
    t2 = time.perf_counter()
    if u_err:
        failures.append(f"unprepare: {u_err}")
    out.cycles += 1
    out.failed_calls += len(failures)
    if not err:
        out.prepare_ms.append((t1 - t0) * 1000)
    if not u_err:
        out.unprepare_ms.append((t2 - t1) * 1000)
    if not failures:
        out.cycles_ok += 1
    out.errors += failures[: max(0, 5 - len(out.errors))]


def run_cycles(
    stub: dra_pb2_grpc.DRAPluginStub, per_caller: Sequence[Sequence[BenchClaim]], cycles: int
) -> LoadResult:
    """`cycles` prepare+unprepare cycles per caller, each caller (a thread) going round its own
    claims; all callers start together. Elapsed time runs from that start to the last end."""
    results = [LoadResult() for _ in per_caller]
    start = threading.Barrier(len(per_caller) + 1)

    def caller(claims: Sequence[BenchClaim], out: LoadResult) -> None:
        start.wait()
        for i in range(cycles):
            _cycle(stub, claims[i % len(claims)], out)

    threads = [
        threading.Thread(target=caller, args=(claims, out), daemon=True)
        for claims, out in zip(per_caller, results, strict=True)
    ]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    total = LoadResult(elapsed_s=time.perf_counter() - began)
    for result in results:
        total.add(result)
    return total
