"""A fraction's ``share.computeLimit`` (burstable fractions): parsed and refused with exact
texts, allowed only on a shared GPU, never below the compute the request reserves, and
checked by admission the way prepare checks it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexgpu.controller.admission import validate_resource_claim
from flexgpu.driver.config_resolution import request_compute_percents, validate_config_entries
from flexgpu.driver.config_support import unsupported_on_device
from flexgpu.driver.opaque_config import GpuConfig, OpaqueConfigError, parse_opaque_config

V = "gpu.flexgpu.dev/v1alpha1"
DRIVER = "gpu.flexgpu.dev"
ALLOWED = "an integer from 1 to 100, at least the request's compute"


def burst(share: object, **sharing: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": V, "kind": "GpuConfig", "share": share}
    return body | ({"sharing": sharing} if sharing else {})


def test_a_compute_limit_parses_and_round_trips() -> None:
    config = parse_opaque_config(burst({"computeLimit": 80}))
    assert isinstance(config, GpuConfig)
    assert config.share is not None and config.share.computeLimit == 80
    assert config.to_parameters() == burst({"computeLimit": 80})
    # With MPS settings beside it, and as an empty block (which changes nothing).
    parse_opaque_config(burst({"computeLimit": 100}, strategy="MPS"))
    empty = parse_opaque_config(burst({}))
    assert isinstance(empty, GpuConfig) and empty.share is not None
    assert empty.share.computeLimit is None


def test_without_the_block_nothing_changes() -> None:
    config = parse_opaque_config({"apiVersion": V, "kind": "GpuConfig"})
    assert isinstance(config, GpuConfig) and config.share is None


@pytest.mark.parametrize(
    ("share", "problem"),
    [
        ({"computeLimit": 0}, f"share.computeLimit: 0 is not allowed; allowed: {ALLOWED}"),
        ({"computeLimit": 101}, f"share.computeLimit: 101 is not allowed; allowed: {ALLOWED}"),
        ({"computeLimit": "80"}, f'share.computeLimit: "80" is not allowed; allowed: {ALLOWED}'),
        ({"computeLimit": 80.5}, f"share.computeLimit: 80.5 is not allowed; allowed: {ALLOWED}"),
        ({"computeLimit": True}, f"share.computeLimit: true is not allowed; allowed: {ALLOWED}"),
        ({"burst": 80}, "share.burst: unknown field; allowed: computeLimit"),
        (80, "share: 80 is not allowed; allowed: an object with fields computeLimit"),
    ],
)
def test_a_bad_share_block_is_refused_naming_field_value_and_range(
    share: object, problem: str
) -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_opaque_config(burst(share))
    assert caught.value.problems == [problem]


def test_a_mig_config_has_no_share_block() -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_opaque_config({"apiVersion": V, "kind": "MigConfig", "share": {"computeLimit": 50}})
    assert caught.value.problems == ["share: unknown field; allowed: apiVersion, kind, sharing"]


@given(st.integers(min_value=-1000, max_value=1000))
def test_every_integer_is_accepted_exactly_from_1_to_100(limit: int) -> None:
    try:
        parse_opaque_config(burst({"computeLimit": limit}))
    except OpaqueConfigError as error:
        assert not 1 <= limit <= 100
        assert error.problems == [f"share.computeLimit: {limit} is not allowed; allowed: {ALLOWED}"]
    else:
        assert 1 <= limit <= 100


def _config(limit: int) -> GpuConfig:
    config = parse_opaque_config(burst({"computeLimit": limit}))
    assert isinstance(config, GpuConfig)
    return config


def test_the_limit_may_not_be_below_the_reserved_compute() -> None:
    assert unsupported_on_device(_config(30), "shared", "gpu", 30) == []
    assert unsupported_on_device(_config(90), "shared", "gpu", 0) == []
    assert unsupported_on_device(_config(30), "shared", "gpu", None) == []
    (problem,) = unsupported_on_device(_config(20), "shared", "gpu", 30)
    assert problem.render() == (
        'share.computeLimit: 20 is not allowed (below the 30 percent of SMs request "gpu" '
        "reserves); allowed: an integer from 30 to 100"
    )
    # A request beyond the GPU never fits: the scheduler says so, not this check.
    assert unsupported_on_device(_config(20), "shared", "gpu", 130) == []


def test_the_block_is_refused_on_a_whole_gpu() -> None:
    (problem,) = unsupported_on_device(_config(50), "gpu", "train", None)
    assert problem.render() == (
        'share: not supported on a whole GPU (request "train"; the block sets a fraction\'s '
        "limits); allowed: only on a shared GPU (shared-gpu.flexgpu.dev); an MPS client of a "
        "whole GPU is capped with sharing.mpsConfig.defaultActiveThreadPercentage"
    )


def test_request_compute_is_read_per_reference_and_rounded_up_as_the_policy_rounds() -> None:
    requests = [
        {"name": "a", "exactly": {"capacity": {"requests": {"compute": "30"}}}},
        {"name": "b", "exactly": {"capacity": {"requests": {"compute": "29.5"}}}},
        {"name": "c", "exactly": {"capacity": {"requests": {"memory": "4Gi"}}}},
        {"name": "d", "exactly": {"capacity": {"requests": {"compute": "lots"}}}},
        {
            "name": "e",
            "firstAvailable": [
                {"name": "big", "capacity": {"requests": {"compute": "60"}}},
                {"name": "small", "capacity": {"requests": {"compute": 10}}},
            ],
        },
        {"name": "f", "exactly": {"capacity": {"requests": {"compute": True}}}},
        "junk",
    ]
    assert request_compute_percents(requests) == {"a": 30, "b": 30, "e/big": 60, "e/small": 10}
    assert request_compute_percents(None) == {}


def claim(compute: str | None, limit: int, device_class: str = "shared-gpu.flexgpu.dev") -> Any:
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if compute is not None:
        exactly["capacity"] = {"requests": {"memory": "8Gi", "compute": compute}}
    entry = {
        "requests": ["gpu"],
        "opaque": {"driver": DRIVER, "parameters": burst({"computeLimit": limit})},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}], "config": [entry]}},
    }


def test_admission_checks_the_limit_against_the_request() -> None:
    assert validate_resource_claim(claim("30", 80)) == []
    assert validate_resource_claim(claim(None, 80)) == []  # nothing reserved: any limit
    assert validate_resource_claim(claim("30", 20)) == [
        "spec.devices.config[0].opaque.parameters.share.computeLimit: 20 is not allowed "
        '(below the 30 percent of SMs request "gpu" reserves); allowed: an integer from 30 '
        "to 100"
    ]
    (problem,) = validate_resource_claim(claim(None, 50, "gpu.flexgpu.dev"))
    assert problem.startswith(
        "spec.devices.config[0].opaque.parameters.share: not supported on a whole GPU"
    )


def test_each_subrequest_is_checked_against_its_own_compute() -> None:
    requests = [
        {
            "name": "gpu",
            "firstAvailable": [
                {
                    "name": "big",
                    "deviceClassName": "shared-gpu.flexgpu.dev",
                    "capacity": {"requests": {"compute": "60"}},
                },
                {
                    "name": "small",
                    "deviceClassName": "shared-gpu.flexgpu.dev",
                    "capacity": {"requests": {"compute": "20"}},
                },
            ],
        }
    ]
    entry = {"opaque": {"driver": DRIVER, "parameters": burst({"computeLimit": 40})}}
    problems = validate_config_entries(
        [entry],
        path="spec.devices.config",
        request_device_types={"gpu/big": "shared", "gpu/small": "shared"},
        request_compute=request_compute_percents(requests),
    )
    assert problems == [
        "spec.devices.config[0].opaque.parameters.share.computeLimit: 40 is not allowed "
        '(below the 60 percent of SMs request "gpu/big" reserves); allowed: an integer from '
        "60 to 100"
    ]
