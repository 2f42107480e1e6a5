"""The plugin's log settings come from flags or FLEXGPU_LOG_* and are refused by name when
they are not a level or format the daemons know."""

from __future__ import annotations

import pytest

from flexgpu.kubelet_plugin.config import ConfigError
from flexgpu.kubelet_plugin.config_flags import load_config


def test_defaults_flags_and_environment() -> None:
    default = load_config(["--node-name=n"], environ={})
    assert (default.log_level, default.log_format) == ("info", "text")
    from_env = load_config(
        ["--node-name=n"], environ={"FLEXGPU_LOG_LEVEL": "debug", "FLEXGPU_LOG_FORMAT": "json"}
    )
    assert (from_env.log_level, from_env.log_format) == ("debug", "json")
    flag_wins = load_config(
        ["--node-name=n", "--log-level=error"], environ={"FLEXGPU_LOG_LEVEL": "debug"}
    )
    assert flag_wins.log_level == "error"


@pytest.mark.parametrize(
    ("flag", "named"),
    [("--log-level=verbose", "log_level: value 'verbose'"), ("--log-format=xml", "log_format")],
)
def test_unknown_values_are_refused_by_name(flag: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config(["--node-name=n", flag], environ={})
