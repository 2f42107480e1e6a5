"""The comparison benchmark's arithmetic: percentiles, ratios against targets, and the
apiserver metrics it reads. (The benchmark itself asserts nothing about speed.)"""

from __future__ import annotations

import math
import os

from bench.api_meter import parse_metrics
from bench.compare_table import (
    Row,
    flexgpu_at_most,
    percentile,
    ratio_at_least,
    ratio_at_most,
    render,
)
from bench.procstat import cpu_seconds, memory_mib
from bench.syscalls import parse_summary

APF = "apiserver_flowcontrol_dispatched_requests_total"
CLAIMS = 'group="resource.k8s.io",resource="resourceclaims",scope="resource",version="v1"'
METRICS = "\n".join(
    [
        f"# HELP {APF} [BETA] Number of requests executed by API Priority and Fairness",
        f"# TYPE {APF} counter",
        APF + '{flow_schema="flexgpu-plugin",priority_level="workload-high"} 12',
        APF + '{flow_schema="example-plugin",priority_level="workload-high"} 7',
        APF + '{flow_schema="exempt",priority_level="exempt"} 3e+02',
        'apiserver_request_total{code="200",' + CLAIMS + ',subresource="",verb="GET"} 40',
        'apiserver_request_total{code="404",' + CLAIMS + ',subresource="",verb="GET"} 2',
        'apiserver_request_total{code="200",' + CLAIMS + ',subresource="status",verb="PUT"} 5',
        'apiserver_request_duration_seconds_bucket{verb="GET",le="0.1"} 99',
    ]
)


def test_percentile_is_nearest_rank_and_nan_when_empty() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_targets_compare_the_ratio_or_flexgpus_own_value() -> None:
    assert Row("p99", 15.0, 10.0, target=ratio_at_most(1.5)).verdict() == "pass"
    assert Row("p99", 16.0, 10.0, target=ratio_at_most(1.5)).verdict() == "FAIL"
    assert Row("cycles/s", 69.0, 100.0, target=ratio_at_least(0.7)).verdict() == "FAIL"
    assert Row("failed", 0.0, 3.0, target=flexgpu_at_most(0)).verdict() == "pass"
    assert Row("failed", 1.0, 0.0, target=flexgpu_at_most(0)).verdict() == "FAIL"
    assert Row("p50", math.nan, 2.0, target=ratio_at_most(1.5)).verdict() == "n/a"
    assert Row("no target", 1.0, 2.0).verdict() == ""


def test_table_has_one_line_per_row_with_ratio() -> None:
    text = render([Row("prepare p50 ms", 3.0, 2.0, 2, ratio_at_most(1.5))])
    lines = text.splitlines()
    assert len(lines) == 3
    assert "1.500x" in lines[2] and "pass" in lines[2] and "3.00" in lines[2]


def test_metrics_are_summed_per_flow_schema_and_per_request_kind() -> None:
    before = parse_metrics("")
    after = parse_metrics(METRICS)
    assert after.requests_of("flexgpu-plugin", before) == 12
    assert after.requests_of("example-plugin", before) == 7
    assert after.requests_of("absent", before) == 0
    assert after.kinds_since(before) == {
        "GET resourceclaims": 42,
        "PUT resourceclaims status": 5,
    }


def test_own_process_cpu_and_memory_are_readable() -> None:
    assert cpu_seconds(os.getpid()) > 0
    assert memory_mib(os.getpid(), "VmRSS") > 1
    assert memory_mib(os.getpid(), "VmHWM") >= memory_mib(os.getpid(), "VmRSS") - 1


def test_strace_summary_calls_are_read_per_syscall() -> None:
    summary = "\n".join(
        [
            "% time     seconds  usecs/call     calls    errors syscall",
            "------ ----------- ----------- --------- --------- ----------------",
            " 90.00    0.017933          44       400           fsync",
            " 10.00    0.008369          11       700       700 mkdir",
            "------ ----------- ----------- --------- --------- ----------------",
            "100.00    0.026302          23      1100       700 total",
        ]
    )
    assert parse_summary(summary) == {"fsync": 400, "mkdir": 700}
