"""Log output of both daemons: ``--log-level`` and ``--log-format`` (json or text).

JSON is one object per line, for log collectors: ``time`` (UTC, RFC 3339), ``level``,
``logger``, ``message``, then whatever a call site passes in ``extra=`` as fields of their own
(``claim_fields`` names a claim the same way everywhere), and ``exception`` with the
traceback. Text is the familiar one-line form for people running a daemon by hand.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Final, TextIO

LEVELS: Final = ("debug", "info", "warning", "error")
FORMATS: Final = ("json", "text")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD: Final = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
    | {"message", "asctime", "taskName"}
)


def claim_fields(namespace: str, name: str, uid: str) -> dict[str, str]:
    """``extra=`` for a log line about a claim: its namespace, name and UID as fields."""
    return {"claim_namespace": namespace, "claim_name": name, "claim_uid": uid}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Send every logger's records to ``stream`` (stderr) at ``level`` in ``fmt``; replaces
    handlers set up earlier, so calling it twice does not print lines twice."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    # Neither format shows where a call was made or from which thread or process; the
    # logging module's documented switches skip collecting that for every record (the
    # plugin logs each prepare, and collecting it cost about as much as the write).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
