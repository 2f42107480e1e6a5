"""DRA structured-parameters allocation, evaluated offline: can a claim be allocated, and why not.

Pure functions over parsed API objects (no API calls, no I/O): the controller uses them to
explain claims that stay pending, ``flexgpu explain`` / ``flexgpu capacity`` from a workstation.
The rules mirror the scheduler's structured allocator (Kubernetes 1.37 with partitionable
devices, consumable capacity, device taints, prioritized lists and admin access enabled); the
differential integration test holds them to the real kube-scheduler.

CEL library: ``cel-python`` (module ``celpy``). It is pure Python and lets values be any Python
object, so quantities and semantic versions are real types with numeric equality and ordering,
and member calls (``q.compareTo(other)``) dispatch to our functions; it gives CEL's
error-absorbing ``&&``/``||`` and ``has()``, which selectors rely on. The alternative,
``common-expression-language`` (Rust ``cel`` bindings), is much faster but converts every value
to a built-in CEL type, so a quantity could only be a string or a map, with wrong equality
(``quantity("1Gi") == quantity("1024Mi")``) and no way to tell a quantity from a string. Speed
matters little here: selector results are cached per device and request, compiled programs per
expression. Neither library parses CEL's optional syntax (``.?name``, ``orValue``).
"""

from flexgpu.driver.allocation.allocator import (
    DeviceChoice,
    Verdict,
    allocate,
)
from flexgpu.driver.allocation.anywhere import ClusterVerdict, allocate_anywhere
from flexgpu.driver.allocation.explain import explain_claim
from flexgpu.driver.allocation.explain_model import Explanation, RequestDiagnosis
from flexgpu.driver.allocation.model import (
    DeviceClass,
    Node,
    ParseError,
    ResourceClaim,
    ResourceSlice,
    parse_claim,
    parse_device_class,
    parse_node,
    parse_slice,
)
from flexgpu.driver.allocation.state import AllocatedState, allocated_state
from flexgpu.driver.allocation.summary import CapacityRow, capacity_summary

__all__ = [
    "AllocatedState",
    "CapacityRow",
    "ClusterVerdict",
    "DeviceChoice",
    "DeviceClass",
    "Explanation",
    "Node",
    "ParseError",
    "RequestDiagnosis",
    "ResourceClaim",
    "ResourceSlice",
    "Verdict",
    "allocate",
    "allocate_anywhere",
    "allocated_state",
    "capacity_summary",
    "explain_claim",
    "parse_claim",
    "parse_device_class",
    "parse_node",
    "parse_slice",
]
