"""How the real node's chart install names the flexgpu image: through the chart's own image
values, by digest or tag from the local registry, or side-loaded (nothing to pull)."""

from __future__ import annotations

import pytest

from tools.node.chart import image_values

REGISTRY = "127.0.0.1:5123"
DIGEST = "sha256:" + "a" * 64


def test_an_image_in_the_registry_by_digest_pins_image_digest() -> None:
    values = image_values(REGISTRY, f"{REGISTRY}/flexgpu/flexgpu@{DIGEST}")
    assert values == {
        "image.registry": REGISTRY,
        "image.repository": "flexgpu/flexgpu",
        "image.digest": DIGEST,
        "image.pullPolicy": "IfNotPresent",
    }


def test_an_image_in_the_registry_by_tag_clears_the_digest() -> None:
    values = image_values(REGISTRY, f"{REGISTRY}/flexgpu/flexgpu:upgrade-1")
    assert values["image.tag"] == "upgrade-1"
    assert values["image.digest"] == ""
    assert values["image.pullPolicy"] == "IfNotPresent"


@pytest.mark.parametrize("registry", ["", REGISTRY])
def test_a_side_loaded_image_is_never_pulled(registry: str) -> None:
    values = image_values(registry, "local.flexgpu.dev/flexgpu:abc")
    assert values == {
        "image.registry": "",
        "image.repository": "local.flexgpu.dev/flexgpu",
        "image.tag": "abc",
        "image.pullPolicy": "Never",
    }
