"""The worker's KVBM endpoint: Prometheus metrics and tier introspection, on 127.0.0.1 by default.

One small threaded HTTP server per scheduler, started when ``DYN_KVBM_METRICS`` is
set (KVBM's own switch, on ``DYN_KVBM_METRICS_PORT``, 6880 by default):

* ``GET /metrics``: Prometheus text (KVBM's metric names),
* ``GET /stats``: the same counters and tier occupancy as JSON,
* ``POST /tiers``: ``{"token_ids": [...], "cache_salt"?: str, "extra_key"?: str}`` ->
  ``{"device": n, "host": n, "disk": n}``, the tokens each tier would serve now
  (cumulative, like Dynamo's indexer ``/query``).

Request bodies are JSON (never pickled or evaluated) and capped in size.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

MAX_BODY = 8 << 20
Handler = Callable[[Optional[dict]], tuple[int, str, bytes]]


class KvbmHttpServer:
    def __init__(self, host: str, port: int, routes: dict[tuple[str, str], Handler]) -> None:
        self._routes = routes
        server = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                self._dispatch("GET", None)

            def do_POST(self):  # noqa: N802
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not 0 <= length <= MAX_BODY:
                    self._reply(413 if length > MAX_BODY else 400, "application/json",
                                b'{"error": "Content-Length must be 0 to 8 MiB"}')
                    return
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except (ValueError, RecursionError):
                    self._reply(400, "application/json", b'{"error": "body is not JSON"}')
                    return
                self._dispatch("POST", body if isinstance(body, dict) else None)

            def _dispatch(self, method: str, body: Optional[dict]) -> None:
                route = server._routes.get((method, self.path.split("?")[0]))
                if route is None:
                    self._reply(404, "application/json", b'{"error": "no such endpoint"}')
                    return
                try:
                    status, ctype, payload = route(body)
                except Exception as exc:  # a bad query must not take the endpoint down
                    logger.exception("kvbm: %s %s failed", method, self.path)
                    status, ctype, payload = 500, "application/json", json.dumps({"error": repr(exc)}).encode()
                self._reply(status, ctype, payload)

            def _reply(self, status: int, ctype: str, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("kvbm http: " + fmt, *args)

        self._server = ThreadingHTTPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self.address = self._server.server_address
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvbm-http", daemon=True)
        self._thread.start()
        logger.info("kvbm: metrics and tier endpoint on http://%s:%d", host, self.address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def json_reply(payload: Any, status: int = 200) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(payload).encode()
