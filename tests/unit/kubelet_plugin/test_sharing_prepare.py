"""Sharing through prepare: time-slicing set and restored, one MPS daemon per GPU for as long
as a claim uses it, GPU shares limited to what the scheduler granted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.claim_results import AllocatedDevice, parse_consumed_capacity
from flexgpu.driver.gpu_model import ComputeMode, TimeSliceInterval
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView, parse_claim
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.claims.startup_reconcile import reconcile_at_start
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef

NODE = "node-a"
DRIVER = "gpu.flexgpu.dev"
API = "gpu.flexgpu.dev/v1alpha1"


class Claims:
    def __init__(self) -> None:
        self.views: dict[str, ClaimView] = {}

    def add(
        self, name: str, devices: list[AllocatedDevice], configs: list[dict[str, Any]] | None = None
    ) -> ClaimRef:
        self.views[name] = ClaimView(
            f"uid-{name}", "ns", name, True, tuple(devices), tuple(configs or ())
        )
        return ClaimRef("ns", name, f"uid-{name}")

    def get(self, namespace: str, name: str) -> ClaimView | None:
        return self.views.get(name)


def config(parameters: dict[str, Any], source: str = "FromClaim") -> dict[str, Any]:
    return {"source": source, "opaque": {"driver": DRIVER, "parameters": parameters}}


def whole(device: str) -> AllocatedDevice:
    return AllocatedDevice("gpu", DRIVER, NODE, device)


def share(device: str, share_id: str, memory: str, compute: str = "0") -> AllocatedDevice:
    return AllocatedDevice(
        "gpu",
        DRIVER,
        NODE,
        device,
        share_id=share_id,
        consumed_capacity=parse_consumed_capacity({"memory": memory, "compute": compute}),
    )


@pytest.fixture
def backend(tmp_path: Path) -> SimulatedBackend:
    return SimulatedBackend.from_topology("l4-2-pcie", NODE, state_path=tmp_path / "gpus.json")


@pytest.fixture
def claims() -> Claims:
    return Claims()


def make_preparer(tmp_path: Path, backend: SimulatedBackend, claims: Claims) -> ClaimPreparerImpl:
    made = ClaimPreparerImpl(
        node_name=NODE,
        claims=claims,
        devices=NodeDevices(backend, shared={1}),
        store=CheckpointStore(tmp_path / "data" / "checkpoint.json"),
        lock=PrepareLock(tmp_path / "data" / "lock"),
        cdi_dir=tmp_path / "cdi",
    )
    made.holders.wait_s = 0  # refusals at once (waiting: test_holder_wait.py)
    return made


@pytest.fixture
def preparer(tmp_path: Path, backend: SimulatedBackend, claims: Claims) -> ClaimPreparerImpl:
    return make_preparer(tmp_path, backend, claims)


def spec_env(preparer: ClaimPreparerImpl, uid: str) -> dict[str, str]:
    spec = json.loads(preparer.spec_path(uid).read_text())
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def test_time_slicing_is_set_and_restored_by_the_last_claim(
    preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    ts = config(
        {
            "apiVersion": API,
            "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
        }
    )
    first = claims.add("a", [whole("gpu-0")], [ts])
    assert preparer.prepare([first])[first.uid].error == ""
    assert backend.time_slice(0) == TimeSliceInterval.LONG
    (own,) = [v for k, v in spec_env(preparer, first.uid).items() if k.startswith("FLEXGPU_DEV")]
    assert ";device=gpu-0;timeSlice=Long;boot=" in own  # tells the workload what it runs under
    preparer.unprepare([first])
    assert backend.time_slice(0) == TimeSliceInterval.DEFAULT


def test_mps_on_a_whole_gpu_limits_each_client(
    preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    mps = config(
        {
            "apiVersion": API,
            "kind": "GpuConfig",
            "sharing": {
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultActiveThreadPercentage": 50,
                    "defaultPinnedDeviceMemoryLimit": "4Gi",
                },
            },
        }
    )
    ref = claims.add("m", [whole("gpu-0")], [mps])
    assert preparer.prepare([ref])[ref.uid].error == ""
    (daemon,) = backend.mps_daemons()
    env = spec_env(preparer, ref.uid)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == daemon.pipe_dir
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    spec = json.loads(preparer.spec_path(ref.uid).read_text())
    mounts = {m["containerPath"] for m in spec["devices"][0]["containerEdits"]["mounts"]}
    # The pipe and shared memory; never the daemon's log folder.
    assert mounts == {daemon.pipe_dir, "/dev/shm"}
    assert "CUDA_MPS_LOG_DIRECTORY" not in env
    preparer.unprepare([ref])
    assert backend.mps_daemons() == []


def test_shares_get_the_granted_limits_and_one_daemon_serves_them_all(
    preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    a = claims.add("a", [share("gpu-1", "s1", "8Gi")])
    b = claims.add("b", [share("gpu-1", "s2", "4Gi", compute="30")])
    results = preparer.prepare([a, b])
    assert results[a.uid].error == results[b.uid].error == ""
    assert results[a.uid].devices[0].share_id == "s1"
    total = backend.list_gpus()[1].memory_mib
    env_a, env_b = spec_env(preparer, a.uid), spec_env(preparer, b.uid)
    assert env_a["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    # No compute granted: SMs capped in proportion to memory (8 GiB of an L4's 22.5 GiB).
    assert env_a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(-(-8192 * 100 // total))
    assert env_b["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert backend.mps_starts(1) == 1
    assert backend.get_compute_mode(1) == ComputeMode.EXCLUSIVE_PROCESS
    preparer.unprepare([a])
    assert [d.gpu_index for d in backend.mps_daemons()] == [1]  # b still uses it
    preparer.unprepare([b])
    assert backend.mps_daemons() == []


class RawClaims:
    """Claims kept as the API's JSON and parsed as ApiClaimSource parses them."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        self.objects = {o["metadata"]["name"]: o for o in objects}

    def get(self, namespace: str, name: str) -> ClaimView | None:
        obj = self.objects.get(name)
        return None if obj is None else parse_claim(obj)


def raw_share(name: str, memory: str) -> dict[str, Any]:
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1"}
    result |= {"shareID": f"s-{name}", "consumedCapacity": {"memory": memory}}
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": f"uid-{name}"},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def test_a_malformed_consumed_capacity_fails_only_that_claim_naming_the_field(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    preparer = ClaimPreparerImpl(
        node_name=NODE,
        claims=RawClaims(raw_share("bad", "8GB"), raw_share("good", "8Gi")),
        devices=NodeDevices(backend, shared={1}),
        store=CheckpointStore(tmp_path / "data" / "checkpoint.json"),
        lock=PrepareLock(tmp_path / "data" / "lock"),
        cdi_dir=tmp_path / "cdi",
    )
    bad, good = ClaimRef("ns", "bad", "uid-bad"), ClaimRef("ns", "good", "uid-good")
    results = preparer.prepare([bad, good])
    assert results[bad.uid].error == (
        "claim ns/bad: status.allocation.devices.results[0].consumedCapacity.memory: "
        "'8GB' is not a Kubernetes quantity: unknown suffix \"GB\""
    )
    assert results[good.uid].error == ""
    records = preparer.load_checkpoint().claims
    assert set(records) == {good.uid}
    # The granted amount is recorded as the claim wrote it, not as a number.
    assert records[good.uid].devices[0].consumed_capacity == {"memory": "8Gi"}


def test_a_share_beyond_the_devices_capacity_is_refused(
    preparer: ClaimPreparerImpl, claims: Claims
) -> None:
    a = claims.add("a", [share("gpu-1", "s1", "20Gi")])
    b = claims.add("b", [share("gpu-1", "s2", "4Gi")])
    assert preparer.prepare([a])[a.uid].error == ""
    error = preparer.prepare([b])[b.uid].error
    assert error.startswith("share s2 of gpu-1 would take memory to 24576Mi of 2")
    assert "the device's other shares already hold the rest" in error


@pytest.mark.parametrize(
    ("devices", "params", "message"),
    [
        (
            [share("gpu-1", "s1", "2Gi")],
            {"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}},
            'claim ns/c: config[0].opaque.parameters.sharing.strategy: "TimeSlicing" is not '
            'supported on a shared GPU (request "gpu"; a share is enforced with MPS); allowed: '
            "Exclusive, MPS",
        ),
        (
            [whole("gpu-0"), share("gpu-1", "s1", "2Gi")],
            {"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "MPS"}},
            "claim ns/c uses MPS on gpu-0, gpu-1; a container talks to one MPS daemon",
        ),
        (
            [whole("gpu-0")],
            {"apiVersion": API, "kind": "MigConfig"},
            'request "gpu": MigConfig cannot configure a whole GPU (gpu-0); use GpuConfig',
        ),
        (
            [whole("gpu-0")],
            {"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "X"}},
            "claim ns/c: ",
        ),
    ],
)
def test_bad_sharing_is_a_per_claim_error_that_creates_nothing(
    preparer: ClaimPreparerImpl,
    backend: SimulatedBackend,
    claims: Claims,
    devices: list[AllocatedDevice],
    params: dict[str, Any],
    message: str,
) -> None:
    ref = claims.add("c", devices, [{**config(params), "requests": ["gpu"]}])
    error = preparer.prepare([ref])[ref.uid].error
    assert message in error
    assert backend.mps_daemons() == [] and not preparer.cdi_dir.exists()
    assert preparer.load_checkpoint().claims == {}


def test_restart_adopts_the_daemon_of_prepared_claims_and_stops_leftovers(
    tmp_path: Path, preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    ref = claims.add("a", [share("gpu-1", "s1", "8Gi")])
    preparer.prepare([ref])
    backend.start_mps_daemon(0)  # a leftover no claim owns

    restarted_backend = SimulatedBackend.from_topology(
        "l4-2-pcie", NODE, state_path=tmp_path / "gpus.json"
    )
    restarted = make_preparer(tmp_path, restarted_backend, claims)
    report = reconcile_at_start(
        restarted, CheckpointStore(tmp_path / "data" / "checkpoint.json"), claims
    )
    assert report.mps_daemons_stopped == [0]
    assert [d.gpu_index for d in restarted_backend.mps_daemons()] == [1]
    assert restarted_backend.mps_starts(1) == 1
    # The next share on that GPU uses the adopted daemon rather than starting another.
    other = claims.add("b", [share("gpu-1", "s2", "4Gi")])
    assert restarted.prepare([other])[other.uid].error == ""
    assert restarted_backend.mps_starts(1) == 1


def burstable(limit: int, requests: list[str] | None = None) -> dict[str, Any]:
    parameters = {"apiVersion": API, "kind": "GpuConfig", "share": {"computeLimit": limit}}
    return config(parameters) | ({"requests": requests} if requests else {})


def test_a_burstable_share_gets_its_limit_and_still_consumes_only_its_request(
    preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    a = claims.add("a", [share("gpu-1", "s1", "4Gi", compute="30")], [burstable(80)])
    # 30 + 70 requested: the GPU holds both, though 80 + 70 of limits exceed it.
    b = claims.add("b", [share("gpu-1", "s2", "4Gi", compute="70")])
    results = preparer.prepare([a, b])
    assert results[a.uid].error == results[b.uid].error == ""
    assert spec_env(preparer, a.uid)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "80"
    assert spec_env(preparer, b.uid)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    # Memory is not burstable: the pinned limit is the request.
    assert spec_env(preparer, a.uid)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    record = preparer.load_checkpoint().claims[a.uid]
    assert record.devices[0].consumed_capacity == {"memory": "4Gi", "compute": "30"}
    mps = record.created.mps_share
    assert mps is not None and mps.active_thread_percentage == 80
    # A third share asking for compute finds none left: requests count, limits do not.
    c = claims.add("c", [share("gpu-1", "s3", "1Gi", compute="1")])
    assert "would take compute to 101% of 100%" in preparer.prepare([c])[c.uid].error


def test_a_memory_only_share_bursts_to_its_limit_instead_of_its_memory_proportion(
    preparer: ClaimPreparerImpl, claims: Claims
) -> None:
    ref = claims.add("a", [share("gpu-1", "s1", "2Gi")], [burstable(50)])
    assert preparer.prepare([ref])[ref.uid].error == ""
    assert spec_env(preparer, ref.uid)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_a_limit_below_the_granted_compute_is_refused_and_creates_nothing(
    preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    ref = claims.add("c", [share("gpu-1", "s1", "2Gi", compute="40")], [burstable(25, ["gpu"])])
    assert preparer.prepare([ref])[ref.uid].error == (
        "claim ns/c: config[0].opaque.parameters.share.computeLimit: 25 is not allowed (below "
        'the 40 percent of SMs request "gpu" reserves); allowed: an integer from 40 to 100'
    )
    assert backend.mps_daemons() == [] and not preparer.cdi_dir.exists()
    assert preparer.load_checkpoint().claims == {}


def test_the_share_block_on_a_whole_gpu_is_refused(
    preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    ref = claims.add("w", [whole("gpu-0")], [burstable(60)])
    error = preparer.prepare([ref])[ref.uid].error
    assert error.startswith(
        "claim ns/w: config[0].opaque.parameters.share: not supported on a whole GPU"
    )
    assert preparer.load_checkpoint().claims == {}


def test_an_admin_access_share_and_two_requests_on_one_gpu_get_their_limits(
    preparer: ClaimPreparerImpl, claims: Claims
) -> None:
    monitor = AllocatedDevice(
        "gpu",
        DRIVER,
        NODE,
        "gpu-1",
        admin_access=True,
        share_id="m1",
        consumed_capacity=parse_consumed_capacity({"memory": "1Gi", "compute": "0"}),
    )
    m = claims.add("m", [monitor], [burstable(10)])
    # One claim, two requests on one GPU: one MPS client, whose limits add up (capped at 100).
    first = share("gpu-1", "s1", "2Gi", compute="20")
    second = AllocatedDevice(
        "other",
        DRIVER,
        NODE,
        "gpu-1",
        share_id="s2",
        consumed_capacity=parse_consumed_capacity({"memory": "2Gi", "compute": "20"}),
    )
    two = claims.add("two", [first, second], [burstable(60)])
    results = preparer.prepare([m, two])
    assert results[m.uid].error == results[two.uid].error == ""
    assert spec_env(preparer, m.uid)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    assert spec_env(preparer, two.uid)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
