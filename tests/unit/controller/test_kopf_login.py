"""kopf logs in with the kubernetes client's credentials, whatever form its token takes."""

from __future__ import annotations

from kubernetes import client

from flexgpu.controller.kopf_login import connection_info


def _configuration(**api_key: str) -> client.Configuration:
    configuration = client.Configuration(host="https://api.example:6443")
    configuration.api_key = dict(api_key)
    return configuration


def test_a_prefixed_token_keeps_its_scheme() -> None:
    info = connection_info(_configuration(authorization="Bearer abc"))
    assert (info.server, info.scheme, info.token) == ("https://api.example:6443", "Bearer", "abc")


def test_a_bare_token_is_sent_as_bearer() -> None:
    info = connection_info(_configuration(authorization="abc"))
    assert (info.scheme, info.token) == ("Bearer", "abc")


def test_no_token_means_no_scheme() -> None:
    info = connection_info(_configuration())
    assert (info.scheme, info.token) == (None, None)
