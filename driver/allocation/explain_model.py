"""What an explanation of a claim holds: per request, how many devices of its class each
reason rules out and which, and the paragraph a workload author reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flexgpu.driver.allocation.allocator import Outcome
from flexgpu.driver.allocation.state import DeviceId

# Reasons a device in the request's class is not usable, in the order they are checked.
REASONS = (
    "selector_error",
    "not_selected",
    "unreachable",
    "allocated",
    "tainted",
    "too_small",
    "capacity_used",
    "counters_spent",
)


@dataclass(frozen=True)
class RequestDiagnosis:
    request: str  # "name" or "name/alternative"
    device_class: str
    wanted: int | None  # None for allocationMode All
    in_class: int
    matching: int  # in the class and selected by the request's selectors
    free: int  # matching and usable on its own
    excluded: Mapping[str, int]  # reason (see REASONS) -> number of devices in the class
    most_free_on_one_node: int
    holders: tuple[str, ...] = ()  # claims holding matching devices
    near_misses: str = ""  # devices in the class the selectors leave out, summarized
    selector_error: str = ""
    message: str = ""
    # The devices behind each count: a REASONS entry or "free" -> device ids, in allocation
    # order. Callers that know more than the evaluator (which nodes a pod may use and why,
    # where a device sits) name the nodes, taints and sizes with them.
    devices: Mapping[str, tuple[DeviceId, ...]] = field(default_factory=dict)
    # Usable node -> free matching devices it can reach; nodes without any are left out, and
    # a node with a free shared device counts as having room for any number.
    room: Mapping[str, float] = field(default_factory=dict)
    # The most matching devices one usable node has even with nothing else allocated (None:
    # not computed): a request for more can never fit, since a pod's devices are its node's.
    most_on_one_node: int | None = None
    # For a matchAttribute constraint on the request: (attribute, the most matching devices
    # of one node sharing one value of it, nothing else allocated).
    largest_match: tuple[str, int] | None = None


@dataclass(frozen=True)
class Explanation:
    claim: str
    outcome: Outcome
    allocatable_nodes: tuple[str, ...]
    requests: tuple[RequestDiagnosis, ...] = field(default_factory=tuple)
    message: str = ""
