"""`filter-pipeline review`: the review web app over the data root (pages, JSON API, labelling)."""

import argparse
import errno
import os
import socket

from filter_pipeline.cli import EXIT_BAD_INPUT, add_data_argument, complain
from filter_pipeline.settings import LOOPBACK

DEFAULT_HOST = LOOPBACK[0]  # loopback: the app has no login, so it is reachable from this machine only unless told
DEFAULT_PORT = 8765


def add_parser(commands) -> None:
    r = commands.add_parser(
        "review",
        help="browse every run's and task's fate and label trajectories in a local web app",
        description="Serve the review app: runs, each run's tasks with their fate, a task's whole story, the "
        "labelling queue and a JSON API. Read-only except for labels, appended to <data>/labels.jsonl.",
    )
    add_data_argument(r)
    r.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    r.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    r.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name the app is also reached by (a reverse proxy's public name, this machine's name on the LAN); "
        "repeatable. Requests naming any other host are refused, unless --host is 0.0.0.0 or ::",
    )


def review(args: argparse.Namespace) -> int:
    import uvicorn

    from filter_pipeline.cli.data_root import existing_root
    from filter_pipeline.review.app import create_app

    root = existing_root(args.data)
    if root is None:
        return EXIT_BAD_INPUT
    if not 0 < args.port < 65536:
        complain(f"--port {args.port}: expected 1 to 65535")
        return EXIT_BAD_INPUT
    try:  # (listening first: a port in use is one line, before any run is read)
        listening = _listen(args.host, args.port)
    except OSError as exc:
        complain(_cannot_listen(args.host, args.port, exc))
        return EXIT_BAD_INPUT
    print(f"review app for {root}: {app_url(args.host, args.port)} (Ctrl-C to stop)", flush=True)
    if args.host not in LOOPBACK:
        complain(
            f"the review app has no login: anyone who reaches {args.host}:{args.port} can read the "
            "trajectories and write labels"
        )
    app = create_app(root, host=args.host, allowed_hosts=tuple(args.allowed_host))
    app.state.review.warehouse.warm_in_background()  # the newest runs' pages answer at once
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])
    return 0


def app_url(host: str, port: int) -> str:
    """The address a browser opens: an IPv6 address in brackets (`http://[::1]:8765/`)."""
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port as uvicorn would bind it: IPv6 for an address with a colon (`::` on
    IPv4 too, where the system can), IPv4 otherwise."""
    if ":" not in host:
        return socket.create_server((host, port), family=socket.AF_INET)
    dual = host == "::" and socket.has_dualstack_ipv6()
    return socket.create_server((host, port), family=socket.AF_INET6, dualstack_ipv6=dual)


def _cannot_listen(host: str, port: int, exc: OSError) -> str:
    if isinstance(exc, socket.gaierror) or (exc.errno or 0) < 0:  # (create_server re-raises the resolver's)
        return f"--host {host}: no such address (the name does not resolve to one)"
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    advice = ": is another app on it? choose another --port" if exc.errno == errno.EADDRINUSE else ""
    return f"cannot listen on {host}:{port} ({why}){advice}"
