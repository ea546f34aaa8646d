"""A real HTTP server on 127.0.0.1 speaking the OpenAI chat-completions protocol, standing in for the
judge model (the one thing that cannot run here). Tests script its behaviour per call."""

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


@dataclass
class Reply:
    content: str = '{"passed": true, "why": "looks done"}'
    status: int = 200
    delay: float = 0.0
    headers: dict = field(default_factory=dict)
    body: str | None = None  # raw body instead of a chat completion


@dataclass
class Call:
    body: dict
    headers: dict

    @property
    def prompt(self) -> str:
        content = self.body["messages"][-1]["content"]
        return content if isinstance(content, str) else content[0]["text"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: the default of 5 resets connections under load


Responder = Callable[[Call, int], Reply]  # (the call, how many calls came before it) -> reply


class FakeOpenAI:
    """`with FakeOpenAI(responder) as server:` ... `server.base_url` ... `server.calls`."""

    def __init__(self, responder: Responder = lambda call, n: Reply()):
        self.responder = responder
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers do
            disable_nagle_algorithm = True  # headers and body go out in separate writes

            def do_POST(self):  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                call = Call(body=body, headers=dict(self.headers))
                with outer._lock:
                    n = len(outer.calls)
                    outer.calls.append(call)
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(Reply(status=404, body='{"error": "not found"}'))
                self._send(outer.responder(call, n))

            def _send(self, reply: Reply):
                if reply.delay:
                    time.sleep(reply.delay)
                payload = reply.body if reply.body is not None else json.dumps(
                    {
                        "id": "chatcmpl-test",
                        "object": "chat.completion",
                        "model": "judge-test",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.content}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
                    }
                )
                data = payload.encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "FakeOpenAI":
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


def main() -> None:
    """Serve a model that passes everything after --latency seconds; prints the base URL, then serves
    until killed. Used by the benchmark so server and client do not share one interpreter lock."""
    import argparse
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--latency", type=float, default=0.2)
    args = parser.parse_args()
    server = FakeOpenAI(lambda call, n: Reply(delay=args.latency))
    print(server.base_url, flush=True)
    sys.stdout.close()
    server._server.serve_forever()


if __name__ == "__main__":
    main()
