"""A real HTTP server on 127.0.0.1 speaking the OpenAI chat-completions protocol, standing in for the
judge model (the one thing that cannot run here). Tests script its behaviour per call.

It speaks the wire shapes real servers do: `n` honoured (n choices), ignored (one choice, as some proxies do)
or rejected (400, or llama.cpp's 500); `response_format` accepted or rejected with a 400; `usage` with
`prompt_tokens_details.cached_tokens`; `reasoning_content` beside `content`; `finish_reason`; a token-bucket
rate limit answering 429 with the retry headers a test chooses; OpenAI-shaped error bodies.
"""

import hashlib
import json
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

N_MODES = ("honour", "ignore", "reject400", "reject500")


@dataclass
class Reply:
    content: str | None = '{"passed": true, "why": "looks done"}'
    status: int = 200
    delay: float = 0.0
    body_delay: float = 0.0  # seconds between the headers and the body (a slow proxy streaming it through)
    headers: dict = field(default_factory=dict)
    body: str | None = None  # raw body instead of a chat completion
    choices: list[str] | None = None  # contents of the n choices; default: `content` n times
    finish_reason: str = "stop"
    reasoning_content: str | None = None  # the message's separate reasoning field (DeepSeek, vLLM, SGLang)
    prompt_tokens: int = 100
    completion_tokens: int = 10
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported


def error_body(message: str, kind: str = "invalid_request_error", code: str | int | None = None) -> str:
    """An error body in OpenAI's shape."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


@dataclass
class RateLimit:
    """A token bucket: `per_second` requests a second, bursts of `burst`; beyond it, 429 with `headers`."""

    per_second: float
    burst: float
    headers: dict = field(default_factory=lambda: {"Retry-After": "1"})
    _tokens: float = -1.0
    _at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = (
                self.burst if self._tokens < 0 else min(self.burst, self._tokens + (now - self._at) * self.per_second)
            )
            self._at = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False


@dataclass
class Call:
    body: dict
    headers: dict
    at: float = 0.0  # time.monotonic() of its arrival
    status: int = 0  # what the server answered
    query: str = ""  # the request URL's query (Azure OpenAI's `api-version=...`)

    @property
    def prompt(self) -> str:
        return self.text(-1)

    def text(self, i: int) -> str:
        content = self.body["messages"][i]["content"]
        return content if isinstance(content, str) else content[0]["text"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: the default of 5 resets connections under load

    def handle_error(self, request, client_address):
        # a client hanging up mid-request (the judge gives up on an endpoint that refused it) is routine for a
        # server: the default prints a traceback into the stderr a test reads the CLI's one line from
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


Responder = Callable[[Call, int], Reply]  # (the call, how many calls came before it) -> reply


class FakeOpenAI:
    """`with FakeOpenAI(responder) as server:` ... `server.base_url` ... `server.calls`.

    `n`: what the server does with `n` > 1 (N_MODES); `response_format`: "accept" or "reject" (400);
    `rate`: a RateLimit checked before the responder."""

    def __init__(
        self,
        responder: Responder = lambda call, n: Reply(),
        n: str = "honour",
        response_format: str = "accept",
        rate: RateLimit | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        assert n in N_MODES and response_format in ("accept", "reject")
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
                path, _, query = self.path.partition("?")
                call = Call(body=body, headers=dict(self.headers), at=time.monotonic(), query=query)
                with outer._lock:
                    count = len(outer.calls)
                    outer.calls.append(call)
                if path.rstrip("/") != "/v1/chat/completions":
                    return self._send(call, Reply(status=404, body=error_body(f"no route {self.path}")))
                self._send(call, outer._answer(call, count))

            def _send(self, call: Call, reply: Reply):
                if reply.delay:
                    time.sleep(reply.delay)
                call.status = reply.status
                data = (reply.body if reply.body is not None else outer._completion(call, reply)).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    if reply.body_delay:
                        self.wfile.flush()
                        time.sleep(reply.body_delay)
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client hung up (its timeout): a real server moves on

            def log_message(self, *args):
                pass

        self.n_mode, self.response_format, self.rate = n, response_format, rate
        self._server = _Server(("127.0.0.1", 0), Handler)
        self.scheme = "http"
        if tls is not None:  # HTTPS, with the context's certificate
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def _answer(self, call: Call, count: int) -> Reply:
        if self.rate is not None and not self.rate.allow():
            return Reply(status=429, headers=dict(self.rate.headers), body=error_body(
                "Rate limit reached for requests per second. Please try again later.", "requests", "rate_limit_exceeded"))  # fmt: skip
        n = call.body.get("n", 1)
        if n > 1 and self.n_mode == "reject400":
            return Reply(status=400, body=error_body("n > 1 is not supported by this server", code="invalid_n"))
        if n > 1 and self.n_mode == "reject500":  # what llama.cpp's server answers
            return Reply(
                status=500,
                body=json.dumps(
                    {"error": {"code": 500, "message": "Only one completion choice is allowed", "type": "server_error"}}
                ),
            )
        if "response_format" in call.body and self.response_format == "reject":
            return Reply(status=400, body=error_body(
                "Invalid parameter: 'response_format' of type 'json_schema' is not supported with this model.", code=None))  # fmt: skip
        return self.responder(call, count)

    def _completion(self, call: Call, reply: Reply) -> str:
        n = call.body.get("n", 1) if self.n_mode == "honour" else 1
        contents = reply.choices if reply.choices is not None else [reply.content] * n
        choices = []
        for i, content in enumerate(contents):
            message = {"role": "assistant", "content": content}
            if reply.reasoning_content is not None:
                message["reasoning_content"] = reply.reasoning_content
            choices.append({"index": i, "message": message, "finish_reason": reply.finish_reason})
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens * len(contents),
                 "total_tokens": reply.prompt_tokens + reply.completion_tokens * len(contents)}  # fmt: skip
        if reply.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens}
        return json.dumps({"id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()),
                           "model": call.body.get("model", "judge-test"), "choices": choices, "usage": usage})  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "FakeOpenAI":
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


class BenchModel:
    """The benchmarks' model: answers after `latency` seconds; `unparseable` of the samples (by a hash of the
    exact request and the sample's number, so the same request gets the same replies, as at temperature 0)
    get prose without a verdict, unless structured output was asked for and accepted (constrained decoding
    cannot produce prose). `samples`: whether it answers `n` with n samples drawn apart (a server honouring
    n), else with one. Tokens are about a quarter of the characters; the system message counts as a cached
    prefix once seen."""

    def __init__(self, latency: float, unparseable: float = 0.0, samples: bool = True):
        self.latency, self.unparseable, self.samples = latency, unparseable, samples
        self._prefixes: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, call: Call, count: int) -> Reply:
        messages = call.body["messages"]
        request = json.dumps([messages, call.body.get("temperature"), call.body.get("max_tokens")], sort_keys=True)
        n = call.body.get("n", 1) if self.samples else 1
        contents = [self._content(request + (f"#{i}" if i else ""), call) for i in range(n)]
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        with self._lock:
            cached = len(system) // 4 if system in self._prefixes else 0
            self._prefixes.add(system)
        chars = sum(len(m["content"]) if isinstance(m["content"], str) else 1000 for m in messages)
        return Reply(choices=contents, delay=self.latency, prompt_tokens=chars // 4,
                     completion_tokens=sum(map(len, contents)) // (4 * n), cached_tokens=cached)  # fmt: skip

    def _content(self, drawn_from: str, call: Call) -> str:
        draw = int(hashlib.sha256(drawn_from.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        if draw < self.unparseable and "response_format" not in call.body:
            return "The agent seems to have completed the task, as far as I can tell."
        return '{"reasoning": "the final page shows the item in the cart", "passed": true, "why": "item in cart"}'


def main() -> None:
    """Serve a model (BenchModel) after --latency seconds; prints the base URL, then serves until killed. Used
    by the benchmarks so server and client do not share one interpreter lock."""
    import argparse
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--unparseable", type=float, default=0.0, help="share of requests answered with prose")
    parser.add_argument("--rate", type=float, default=0.0, help="requests a second allowed (token bucket); 0: no limit")
    parser.add_argument("--burst", type=float, default=0.0, help="the bucket's size (default: --rate)")
    parser.add_argument("--retry-after", default="1", help="the Retry-After header of a 429")
    parser.add_argument("--n", choices=N_MODES, default="honour")
    parser.add_argument("--response-format", choices=("accept", "reject"), default="accept")
    args = parser.parse_args()
    rate = RateLimit(args.rate, args.burst or args.rate, {"Retry-After": args.retry_after}) if args.rate else None
    server = FakeOpenAI(
        BenchModel(args.latency, args.unparseable, samples=args.n == "honour"),
        n=args.n,
        response_format=args.response_format,
        rate=rate,
    )
    print(server.base_url, flush=True)
    sys.stdout.close()
    server._server.serve_forever()


if __name__ == "__main__":
    main()
