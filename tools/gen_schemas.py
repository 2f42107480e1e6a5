#!/usr/bin/env python3
"""Regenerate the JSON Schemas of the opaque config kinds (gpu.flexgpu.dev/v1alpha1).

Usage: python tools/gen_schemas.py [--check]

Writes driver/schemas/gpuconfig.json and migconfig.json from the pydantic models in
driver/opaque_config.py. The output is committed; tests/unit/config/test_config_schemas.py keeps
it in sync. --check writes nothing and exits 1 if a checked-in file differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_DIR = REPO_ROOT / "driver" / "schemas"

if str(REPO_ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from flexgpu.driver.opaque_config import json_schemas  # noqa: E402


def rendered() -> dict[str, str]:
    """File name -> file text, exactly as checked in."""
    return {
        name: json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
        for name, schema in sorted(json_schemas().items())
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    stale = []
    for name, text in rendered().items():
        path = SCHEMA_DIR / name
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(name)
        if not args.check:
            SCHEMA_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run python tools/gen_schemas.py", file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote {SCHEMA_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
