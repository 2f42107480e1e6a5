"""Which Xid errors mean the GPU itself is unhealthy.

Some Xids report a fault in the application (an illegal address, a killed context) rather than
in the GPU; the GPU keeps working, so they must not take it out of service.
"""

from __future__ import annotations

# 13 graphics engine exception, 31 MMU fault, 43 channel stopped, 45 preemptive cleanup,
# 68 video processor exception, 109 context switch timeout: all caused by the workload.
APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})


def xid_marks_unhealthy(xid: int) -> bool:
    return xid not in APPLICATION_XIDS
