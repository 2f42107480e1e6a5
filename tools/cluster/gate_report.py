"""Prints each DRA gate's stage and default in a release's binaries, for docs/admin.md:
``python -m tools.cluster.gate_report [FOLDER]`` (default: the selected release's build)."""

from __future__ import annotations

import sys
from pathlib import Path

from tools.cluster.binaries import control_plane_dir
from tools.cluster.feature_gates import describe


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else control_plane_dir()
    print("\n".join(describe(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
