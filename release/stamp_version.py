"""Stamps a release version into the two files that carry it: driver/version.py (read by the
package metadata and every ``--version``) and the chart's version and appVersion.

``python -m release.stamp_version 1.2.3`` (the release workflow runs it with the tag's version
before building the image and packaging the chart); ``--check`` only verifies they agree.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_FILE = ROOT / "driver" / "version.py"
CHART_FILE = ROOT / "charts" / "flexgpu" / "Chart.yaml"
# Semantic versioning 2.0 (pre-release and build parts allowed), as Helm requires.
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$"
)
_PY = re.compile(r'^VERSION: Final = "([^"]*)"$', re.MULTILINE)
_CHART_VERSION = re.compile(r"^version: (.*)$", re.MULTILINE)
_CHART_APP = re.compile(r'^appVersion: "(.*)"$', re.MULTILINE)


class StampError(ValueError):
    """A version or a file the stamp cannot work with."""


def _one(pattern: re.Pattern[str], text: str, where: Path) -> re.Match[str]:
    matches = list(pattern.finditer(text))
    if len(matches) != 1:
        raise StampError(f"{where}: expected one line matching {pattern.pattern!r}")
    return matches[0]


def current() -> dict[str, str]:
    """Each place's version, by a short name."""
    py = VERSION_FILE.read_text()
    chart = CHART_FILE.read_text()
    return {
        "driver/version.py": _one(_PY, py, VERSION_FILE).group(1),
        "Chart.yaml version": _one(_CHART_VERSION, chart, CHART_FILE).group(1).strip(),
        "Chart.yaml appVersion": _one(_CHART_APP, chart, CHART_FILE).group(1),
    }


def stamp(version: str) -> None:
    if not SEMVER.match(version):
        raise StampError(
            f"version {version!r} is not allowed; allowed: a semantic version such as 1.2.3 "
            "or 1.2.3-rc.1 (no leading v)"
        )
    py = VERSION_FILE.read_text()
    _one(_PY, py, VERSION_FILE)
    VERSION_FILE.write_text(_PY.sub(f'VERSION: Final = "{version}"', py))
    chart = CHART_FILE.read_text()
    _one(_CHART_VERSION, chart, CHART_FILE)
    _one(_CHART_APP, chart, CHART_FILE)
    chart = _CHART_VERSION.sub(f"version: {version}", chart)
    CHART_FILE.write_text(_CHART_APP.sub(f'appVersion: "{version}"', chart))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stamp_version", description=__doc__)
    parser.add_argument("version", nargs="?", help="X.Y.Z to write; omit with --check")
    parser.add_argument("--check", action="store_true", help="only check that all agree")
    args = parser.parse_args(argv)
    try:
        if args.check:
            found = current()
            if len(set(found.values())) != 1:
                print(f"stamp_version: versions disagree: {found}", file=sys.stderr)
                return 1
            return 0
        if not args.version:
            parser.error("a version is required unless --check is given")
        stamp(args.version)
    except StampError as err:
        print(f"stamp_version: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
