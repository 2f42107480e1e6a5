"""Can these claims be allocated on this node? The scheduler's structured search, in Python.

The search is first-fit with backtracking, in the scheduler's order: claims, then their requests,
then devices in pool, slice and device order; within one request only combinations (not
permutations) are tried. A device is considered for a request when it is free (or the request has
admin access), passes the class and request selectors, and has the remaining consumable capacity;
it is then taken if its shared counters fit, no untolerated NoSchedule/NoExecute taint is on it
and the claim's constraints still hold. ``firstAvailable`` alternatives are tried in order, and
``allocationMode: All`` fixes the device set up front from every visible device that matches.

Three outcomes, as the scheduler has them: allocatable (with the devices picked), not
allocatable, or an error that stops the scheduler from scheduling the pod at all (a selector that
fails at runtime on a device the search looks at, ``All`` over a pool that is being updated, an
``All`` set that breaks a constraint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, NamedTuple

from flexgpu.driver.allocation import capacity as cap
from flexgpu.driver.allocation.cel import (
    SelectorError,
)
from flexgpu.driver.allocation.constraints import ConstraintState
from flexgpu.driver.allocation.model import (
    ALLOCATION_RESULTS_MAX_SIZE,
    Device,
    DeviceClass,
    Node,
    RequestSpec,
    ResourceClaim,
    ResourceSlice,
)
from flexgpu.driver.allocation.nodes import node_matches
from flexgpu.driver.allocation.pools import Pool, SliceIndex, gather_pools
from flexgpu.driver.allocation.selectors import SelectorCache, tainted
from flexgpu.driver.allocation.state import AllocatedState, DeviceId

Outcome = Literal["allocatable", "unallocatable", "error"]
NOT_ALLOCATABLE = "cannot allocate all claims"  # a node's reason when the search fails there


@dataclass(frozen=True)
class DeviceChoice:
    request: str  # "request" or "request/subrequest"
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    shared: bool = False
    consumed_capacity: Mapping[str, Fraction] | None = None


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    node: str
    # One tuple of devices per claim, in the order the claims were given (when allocatable).
    devices: tuple[tuple[DeviceChoice, ...], ...] = ()
    reason: str = ""

    @property
    def allocatable(self) -> bool:
        return self.outcome == "allocatable"


class AllocationError(Exception):
    """The scheduler would stop scheduling the pod (not merely find this node unsuitable)."""


Position = tuple[int, int, int]  # pool, slice, device index in the pools' order


class At(NamedTuple):
    """Which device the search is looking for: of which claim, request, alternative, and which
    one of the request's devices."""

    claim: int
    request: int = 0
    sub: int = 0
    device: int = 0

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.claim, self.request, self.sub)


class _TooManyResults(Exception):
    """A claim would need more than 32 devices along this branch of the search."""


@dataclass(frozen=True)
class Candidate:
    pool: Pool
    slice: ResourceSlice
    device: Device

    @property
    def id(self) -> DeviceId:
        return (self.pool.driver, self.pool.name, self.device.name)


@dataclass
class _Request:
    spec: RequestSpec
    parent: str | None  # name of the request holding this subrequest
    device_class: DeviceClass
    count: int
    everything: list[Candidate] | None = None  # allocationMode All

    @property
    def base(self) -> str:
        return self.parent if self.parent is not None else self.spec.name

    @property
    def sub(self) -> str | None:
        return self.spec.name if self.parent is not None else None

    @property
    def full_name(self) -> str:
        return f"{self.parent}/{self.spec.name}" if self.parent else self.spec.name


class _Search:
    def __init__(
        self,
        *,
        claims: Sequence[ResourceClaim],
        node: Node,
        pools: list[Pool],
        classes: Mapping[str, DeviceClass],
        state: AllocatedState,
        selectors: SelectorCache,
    ) -> None:
        self.claims = claims
        self.node = node
        self.pools = pools
        self.classes = classes
        self.state = state
        self.selectors = selectors
        self.requests: dict[tuple[int, int, int], _Request] = {}
        self.selected: dict[tuple[int, int], int] = {}
        self.constraints = [[ConstraintState(c) for c in claim.constraints] for claim in claims]
        self.results: list[list[DeviceChoice]] = [[] for _ in claims]
        self.taking: dict[DeviceId, set[int]] = {}
        self.sharing: dict[DeviceId, dict[str, Fraction]] = {}
        self.counters_used: dict[tuple[str, str], dict[str, dict[str, Fraction]]] = {}
        self.counters_free: dict[tuple[str, str], dict[str, dict[str, Fraction]]] = {}
        self.match_cache: dict[tuple[DeviceId, tuple[int, int, int]], bool] = {}

    # --- set-up ------------------------------------------------------------------------------

    def prepare(self) -> None:
        for ci, claim in enumerate(self.claims):
            minimum = 0
            for ri, request in enumerate(claim.requests):
                parent = request.name if request.exactly is None else None
                least = None
                for si, spec in enumerate(request.alternatives()):
                    data = self._request(ci, ri, si, spec, parent)
                    self.requests[(ci, ri, si)] = data
                    least = data.count if least is None else min(least, data.count)
                if least is not None and least > ALLOCATION_RESULTS_MAX_SIZE - minimum:
                    raise AllocationError(
                        f"claim {claim.key}, request {request.name}: needs more than "
                        f"{ALLOCATION_RESULTS_MAX_SIZE} devices"
                    )
                minimum += least or 0

    def _request(
        self, ci: int, ri: int, si: int, spec: RequestSpec, parent: str | None
    ) -> _Request:
        device_class = self.classes[spec.device_class]
        data = _Request(spec, parent, device_class, spec.count)
        if spec.mode != "All":
            return data
        data.everything = []
        for pool in self.pools:
            if pool.incomplete:
                raise AllocationError(
                    f"request {data.full_name}: asks for all devices, but resource pool "
                    f"{pool.driver}/{pool.name} is currently being updated"
                )
            if pool.invalid_reason is not None:
                raise AllocationError(
                    f"request {data.full_name}: asks for all devices, but resource pool "
                    f"{pool.driver}/{pool.name} is invalid ({pool.invalid_reason})"
                )
            for slc in pool.device_slices:
                for device in slc.devices:
                    candidate = Candidate(pool, slc, device)
                    if not self.selectable((ci, ri, si), data, candidate):
                        continue
                    # Only the device's own capacity here: if what others hold leaves too little,
                    # the device stays in the set and "All" fails, as it should.
                    if cap.fits(spec.capacity_requests, device.capacity):
                        data.everything.append(candidate)
        data.count = len(data.everything)
        return data

    # --- checks ------------------------------------------------------------------------------

    def selectable(self, key: tuple[int, int, int], data: _Request, cand: Candidate) -> bool:
        cache_key = (cand.id, key)
        known = self.match_cache.get(cache_key)
        if known is not None:
            return known
        driver, device = cand.slice.driver, cand.device
        claim = self.claims[key[0]]
        result = self.selectors.matches(
            data.device_class.selectors, driver, device, f"class {data.device_class.name}"
        ) and self.selectors.matches(data.spec.selectors, driver, device, f"claim {claim.key}")
        if result and cand.slice.per_device_node_selection:
            result = node_matches(
                self.node, device.node_name, device.all_nodes, device.node_selector
            )
        self.match_cache[cache_key] = result
        return result

    def in_use(self, device: DeviceId) -> bool:
        return device in self.state.exclusive or bool(self.taking.get(device))

    def shared_in_use(self, device: DeviceId) -> bool:
        return (
            device in self.state.consumed or device in self.state.shared or device in self.sharing
        )

    def capacity_fits(self, spec: RequestSpec, cand: Candidate) -> bool:
        return cap.fits(
            spec.capacity_requests,
            cand.device.capacity,
            self.state.consumed.get(cand.id, {}),
            self.sharing.get(cand.id, {}),
        )

    def free_counters(self, pool: Pool) -> dict[str, dict[str, Fraction]]:
        free = self.counters_free.get(pool.key)
        if free is None:
            free = {name: dict(counters) for name, counters in pool.counter_sets.items()}
            for slc in pool.all_device_slices:
                for device in slc.devices:
                    if not self.state.is_allocated((pool.driver, pool.name, device.name)):
                        continue
                    for set_name, counters in device.consumes_counters:
                        for counter, amount in counters.items():
                            if counter in free.get(set_name, {}):
                                free[set_name][counter] -= amount
            self.counters_free[pool.key] = free
        return free

    def take_counters(self, cand: Candidate, sign: int) -> None:
        used = self.counters_used.setdefault(cand.pool.key, {})
        for set_name, counters in cand.device.consumes_counters:
            cap.add_amounts(used.setdefault(set_name, {}), counters, sign)

    def counters_fit(self, cand: Candidate) -> bool:
        free = self.free_counters(cand.pool)
        self.take_counters(cand, 1)
        used = self.counters_used[cand.pool.key]
        for set_name, counters in free.items():
            for counter, available in counters.items():
                if available < used.get(set_name, {}).get(counter, Fraction(0)):
                    self.take_counters(cand, -1)
                    return False
        return True

    # --- taking a device ---------------------------------------------------------------------

    def take(
        self, ci: int, key: tuple[int, int, int], cand: Candidate, must: bool
    ) -> Callable[[], None] | None:
        """Takes the device for the request, or says why not (None); returns how to undo it."""
        data = self.requests[key]
        spec = data.spec
        device, did = cand.device, cand.id
        multiple = device.allow_multiple_allocations
        if not multiple and spec.admin_access and ci in self.taking.get(did, set()):
            return None
        if not spec.admin_access and self.in_use(did):
            return None
        undo: list[Callable[[], None]] = []

        def rollback() -> None:
            for step in reversed(undo):
                step()

        # A further share of a device already shared has had its counters charged once.
        if device.consumes_counters and not (multiple and self.shared_in_use(did)):
            if not self.counters_fit(cand):
                return None
            undo.append(lambda: self.take_counters(cand, -1))
        if tainted(device, spec):
            rollback()
            return None
        for constraint in self.constraints[ci]:
            if not constraint.add(data.base, data.sub, device, cand.slice.driver):
                rollback()
                if must:
                    raise AllocationError(
                        f"claim {self.claims[ci].key}, request {data.full_name}: cannot add "
                        f"device {'/'.join(did)} because a claim constraint would not be satisfied"
                    )
                return None
            undo.append(lambda c=constraint: c.remove(data.base, data.sub))  # type: ignore[misc]
        if not multiple:
            self.taking.setdefault(did, set()).add(ci)
            undo.append(lambda: self.taking[did].discard(ci))
        if not self.capacity_fits(spec, cand):
            rollback()
            return None
        consumed = None
        if multiple:
            consumed = cap.consumption(spec.capacity_requests, device.capacity)
            before = self.sharing.get(did)
            after = dict(before or {})
            cap.add_amounts(after, consumed)
            self.sharing[did] = after

            def restore() -> None:
                if before is None:
                    del self.sharing[did]
                else:
                    self.sharing[did] = before

            undo.append(restore)
        results = self.results[ci]
        results.append(
            DeviceChoice(
                request=data.full_name,
                driver=did[0],
                pool=did[1],
                device=did[2],
                admin_access=spec.admin_access,
                shared=multiple,
                consumed_capacity=consumed,
            )
        )

        def drop() -> None:
            results.pop()

        undo.append(drop)
        return rollback

    # --- the search --------------------------------------------------------------------------

    def candidates(
        self, start: tuple[int, int, int]
    ) -> Iterator[tuple[tuple[int, int, int], Candidate]]:
        for pi in range(start[0], len(self.pools)):
            pool = self.pools[pi]
            if not pool.usable:
                continue
            first_slice = start[1] if pi == start[0] else 0
            for si in range(first_slice, len(pool.device_slices)):
                slc = pool.device_slices[si]
                first_device = start[2] if (pi, si) == start[:2] else 0
                for di in range(first_device, len(slc.devices)):
                    yield (pi, si, di), Candidate(pool, slc, slc.devices[di])

    def one(self, at: At, in_sub: bool, start: Position = (0, 0, 0)) -> bool:
        """Finds devices from ``at`` on; True once every claim is complete. ``start`` is where
        the search for the next device of the same request resumes (combinations only)."""
        if at.claim >= len(self.claims):
            return True
        claim = self.claims[at.claim]
        if at.request >= len(claim.requests):
            try:
                return self.one(At(at.claim + 1), False)
            except _TooManyResults:
                return False
        key = at.key
        data = self.requests[key]
        if not in_sub and data.parent is not None:
            return self._alternatives(at)
        spec = data.spec
        if spec.mode == "All" and not data.everything:
            return False
        if at.device >= data.count:
            return self.one(At(at.claim, at.request + 1), False)
        if data.count - at.device > ALLOCATION_RESULTS_MAX_SIZE - len(self.results[at.claim]):
            raise _TooManyResults
        following = At(at.claim, at.request, at.sub, at.device + 1)
        if data.everything is not None:
            undo = self.take(at.claim, key, data.everything[at.device], must=True)
            if undo is None:
                return False
            return self._continue(undo, following, in_sub, (0, 0, 0))
        for position, cand in self.candidates(start):
            did = cand.id
            if spec.admin_access and at.claim in self.taking.get(did, set()):
                continue
            if not spec.admin_access and self.in_use(did):
                continue
            if not self.selectable(key, data, cand) or not self.capacity_fits(spec, cand):
                continue
            undo = self.take(at.claim, key, cand, must=False)
            if undo is None:
                continue
            after = (position[0], position[1], position[2] + 1)
            if self._continue(undo, following, in_sub, after):
                return True
        return False

    def _continue(self, undo: Callable[[], None], at: At, in_sub: bool, start: Position) -> bool:
        try:
            done = self.one(at, in_sub, start)
        except BaseException:
            undo()
            raise
        if not done:
            undo()
        return done

    def _alternatives(self, at: At) -> bool:
        every_one_too_big = True
        sub = 0
        while (at.claim, at.request, sub) in self.requests:
            try:
                done = self.one(At(at.claim, at.request, sub, at.device), True)
            except _TooManyResults:
                sub += 1
                continue
            every_one_too_big = False
            if done:
                self.selected[(at.claim, at.request)] = sub
                return True
            sub += 1
        if every_one_too_big:
            raise _TooManyResults
        return False


def missing_classes(
    claims: Sequence[ResourceClaim], classes: Mapping[str, DeviceClass]
) -> list[str]:
    return sorted(
        {
            spec.device_class
            for claim in claims
            for request in claim.requests
            for spec in request.alternatives()
            if spec.device_class not in classes
        }
    )


def allocate(
    claims: Sequence[ResourceClaim],
    node: Node,
    slices: Sequence[ResourceSlice],
    classes: Mapping[str, DeviceClass],
    state: AllocatedState,
    *,
    selectors: SelectorCache | None = None,
    index: SliceIndex | None = None,
) -> Verdict:
    """Whether ``claims`` (one pod's unallocated claims) can all be allocated on ``node``.
    ``index``: the same ``slices`` indexed by node, for callers that ask about many nodes."""
    missing = missing_classes(claims, classes)
    if missing:
        return Verdict(
            "unallocatable", node.name, reason=f"device class {missing[0]} does not exist"
        )
    pools = index.pools(node) if index is not None else gather_pools(slices, node)
    search = _Search(
        claims=claims,
        node=node,
        pools=pools,
        classes=classes,
        state=state,
        selectors=selectors or SelectorCache(),
    )
    try:
        search.prepare()
        done = search.one(At(0), False)
    except SelectorError as err:
        return Verdict("error", node.name, reason=err.message)
    except AllocationError as err:
        return Verdict("error", node.name, reason=str(err))
    except _TooManyResults:
        done = False
    if done:
        return Verdict("allocatable", node.name, tuple(tuple(r) for r in search.results))
    invalid = [p for p in pools if p.invalid_reason is not None]
    if invalid:
        reason = f"invalid resource pool {invalid[0].driver}/{invalid[0].name}"
        return Verdict("unallocatable", node.name, reason=f"{reason}: {invalid[0].invalid_reason}")
    return Verdict("unallocatable", node.name, reason=NOT_ALLOCATABLE)
