"""A real HTTP reverse proxy on 127.0.0.1 in front of moto's S3 server, answering some requests the way other
stores or a bad network do: AWS's 409 `ConditionalRequestConflict`, a store that ignores `If-None-Match` /
`If-Match` (older MinIO, some Ceph gateways), a reply lost after the store applied the write, a store out of reach.

`with S3Faults(moto_endpoint) as proxy:` point the client at `proxy.endpoint`; set `proxy.fault` to a function of
the request (`Request`) that returns None (forward it as is) or one of the actions below.
"""

import http.client
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

CONFLICT = "conflict"  # 409 ConditionalRequestConflict, the write not applied (AWS, two conditional writes at once)
IGNORE_CONDITIONS = "ignore conditions"  # forwarded without If-None-Match / If-Match: applied unconditionally
LOSE_REPLY = "lose reply"  # forwarded and applied, then the connection closed without an answer
DROP = "drop"  # the connection closed without an answer, nothing forwarded: the store out of reach

_CONFLICT_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ConditionalRequestConflict</Code><Message>A conflicting '
    b"conditional operation is currently in progress against this resource. Please try again.</Message>"
    b"<RequestId>FAULT</RequestId><HostId>FAULT</HostId></Error>"
)
_CONDITIONS = ("if-none-match", "if-match")


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # /bucket/key, as path-style addressing sends it
    headers: dict[str, str]  # lower-case names

    def conditional(self) -> bool:
        return any(name in self.headers for name in _CONDITIONS)


def once(matches: Callable[[Request], bool], action: str) -> Callable[[Request], str | None]:
    """A fault that answers the first request `matches` accepts with `action` and forwards every other one."""
    done: list[Request] = []

    def fault(request: Request) -> str | None:
        if done or not matches(request):
            return None
        done.append(request)
        return action

    return fault


class S3Faults:
    def __init__(self, upstream: str):
        target = urlsplit(upstream)
        self.fault: Callable[[Request], str | None] = lambda request: None
        self.applied: list[tuple[str, Request]] = []  # (action, request) for each fault applied
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                request = Request(self.command, self.path.partition("?")[0], headers)
                action = outer.fault(request)
                if action is not None:
                    outer.applied.append((action, request))
                if action == CONFLICT:
                    self._answer(409, {"Content-Type": "application/xml"}, _CONFLICT_BODY)
                    return
                if action == DROP:
                    self.close_connection = True
                    return
                if action == IGNORE_CONDITIONS:
                    headers = {k: v for k, v in headers.items() if k not in _CONDITIONS}
                upstream_connection = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    upstream_connection.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream_connection.getresponse()
                    data = answer.read()
                finally:
                    upstream_connection.close()
                if action == LOSE_REPLY:
                    self.close_connection = True
                    return
                self._answer(answer.status, dict(answer.getheaders()), data)

            def _answer(self, status: int, headers: dict, data: bytes) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(name, value)
                # (a HEAD answer's length is the object's, not its empty body's)
                length = (
                    headers.get("Content-Length") or headers.get("content-length") if self.command == "HEAD" else None
                )
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle  # noqa: N815 - http.server's names

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "S3Faults":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
