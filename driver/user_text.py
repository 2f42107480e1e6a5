"""User input echoed back in an error message, kept short.

A claim name, a request name or a field value can be up to megabytes long when it comes from a
malformed request; echoing it whole would bloat logs, Events and gRPC statuses. Every message
that repeats what a user sent passes it through ``shorten`` first. Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

# Long enough for any valid Kubernetes name (253) to stay recognisable from its start.
ECHO_LIMIT: Final = 100


def shorten(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` as is when it has at most ``limit`` characters, else its first ``limit``
    characters, an ellipsis and the original length: ``aaaa... (1048576 characters)``.
    Characters that cannot be encoded (lone surrogates) are escaped."""
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
