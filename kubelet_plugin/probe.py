"""Liveness probe for the plugin's container: ``python -m flexgpu.kubelet_plugin.probe``.

Reads the same flags and FLEXGPU_* variables as the plugin, then asks the plugin what the
kubelet would (kubelet_plugin.kubeletplugin.probe). Exit 0 when both sockets answer in time,
1 otherwise (with the reason on stderr).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from flexgpu.kubelet_plugin.config import ConfigError
from flexgpu.kubelet_plugin.config_flags import load_config
from flexgpu.kubelet_plugin.kubeletplugin import probe as sockets_probe


def probe(argv: Sequence[str] | None = None) -> str | None:
    """None when healthy, else what is wrong."""
    try:
        config = load_config(list(argv or []))
    except ConfigError as err:
        return str(err)
    return sockets_probe.probe(config.registration_socket)


def main() -> int:
    problem = probe(sys.argv[1:])
    if problem:
        print(f"flexgpu-kubelet-plugin probe: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
