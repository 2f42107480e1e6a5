"""The plugin's HTTP health endpoint for the kubelet's probes: ``/livez`` (the plugin's gRPC
services answer what the kubelet asks) and ``/readyz`` (prepares are served and the node's
devices were published). Served from a thread of the plugin itself, so a probe costs one HTTP
request instead of a new Python process per check.

Each answer is 200 ``ok`` or 503 with the reason, which the kubelet shows in the pod's Events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Final

log = logging.getLogger(__name__)

# None when healthy, else what is wrong.
Verdict = Callable[[], str | None]
PATHS: Final = ("/livez", "/readyz")


class HealthEndpoint:
    """``/livez`` and ``/readyz`` on ``port`` (0 asks the OS; ``port`` is then the bound one)."""

    def __init__(
        self, port: int, *, alive: Verdict, ready: Verdict, address: str = "0.0.0.0"
    ) -> None:
        verdicts = {"/livez": alive, "/readyz": ready}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                verdict = verdicts.get(self.path.split("?", 1)[0])
                if verdict is None:
                    self._answer(404, f"not found; try {' or '.join(PATHS)}")
                    return
                try:
                    problem = verdict()
                except Exception as err:  # a failing check is a failed probe, not a crash
                    problem = f"{type(err).__name__}: {err}"
                self._answer(503 if problem else 200, problem or "ok")

            def _answer(self, status: int, text: str) -> None:
                body = (text + "\n").encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                # One line per probe would drown the plugin's log; failures are logged below.
                if args and str(args[1]) != "200":
                    log.info("health probe %s answered %s", self.path, args[1])

        self._server = ThreadingHTTPServer((address, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="health-endpoint", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
