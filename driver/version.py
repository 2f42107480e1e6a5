"""flexgpu's version: the one place it is written.

The package metadata (pyproject reads this attribute), ``--version`` of every command and the
chart's version and appVersion all come from here; ``release/stamp_version.py X.Y.Z`` rewrites
it (and the chart) when a release is tagged, so an image built from tag vX.Y.Z reports X.Y.Z.
"""

from __future__ import annotations

from typing import Final

VERSION: Final = "0.1.0"
