"""The review app: Starlette pages and a JSON API over the data root, read-only except for labels.

Everything shown from a trajectory is untrusted web content: templates autoescape, every response carries a
strict Content-Security-Policy (scripts only from this app's own static files, no inline script or style),
and a screenshot is served only when it is one the judge takes (`prompt.screenshot_files`: inside the data root).
"""

import getpass
import json
import os
from math import ceil
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit

import numpy as np
import pandas as pd
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from upath import UPath

from filter_pipeline.review.data import (
    ERROR_MAX_CHARS,
    ReviewError,
    UnreadableFile,
    UnreadableRun,
    Warehouse,
    matching,
    page,
)
from filter_pipeline.review.fates import FATES, REASON_RETIRED, STATE_LEGACY
from filter_pipeline.review.queue import QueueMemo, item
from filter_pipeline.review.story import Labels, inside_run, plain, screenshot, story
from filter_pipeline.rules.descriptions import one_line
from filter_pipeline.rules.records import is_text
from filter_pipeline.rules.schemas import SCORE_RANGE, VERDICT_FLAGS
from filter_pipeline.settings import DAGSTER_URL_ENV, LABELER_ENV, LOOPBACK, base_url
from filter_pipeline.storage.files import store_trouble
from filter_pipeline.storage.labels import LabelWriteError, append_label, now_iso

HERE = Path(__file__).parent
ANY_ADDRESS = ("0.0.0.0", "::", "")
DEFAULT_LIMIT, MAX_LIMIT = 100, 1000
RUNS_PER_PAGE = 50  # the runs page's and /api/runs' page size by default (a run's figures are read when shown)
REJECTED_LINES_SHOWN = 50  # on a run's page; batch_rejects holds them all
MAX_NOTE_CHARS = 2000
MAX_LABELER_CHARS = 200  # a label's labeler is cut to this
MAX_LABEL_BYTES = 64 << 10  # a label request's body; a note is at most MAX_NOTE_CHARS
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


class BadRequest(ValueError):
    """A request the app cannot answer: one line, sent with a 400."""


def task_href(run_id: str, task_id: str, filters: dict | None = None) -> str:
    """A task page's address: the task_id in the path, or in the query for one a path cannot carry (`.` and `..`,
    which browsers resolve away even escaped, and one with a line break, which no route matches); with the run
    page's `filters`, so that its previous and next are those of the same list."""
    base = f"/runs/{quote(run_id, safe='')}/tasks/"
    query = _query(filters)
    if task_id in (".", "..") or "\n" in task_id:
        return base + "?" + urlencode({"task_id": task_id, **query})
    return base + quote(task_id, safe="") + ("?" + urlencode(query) if query else "")


def _query(filters: dict | None) -> dict:
    """The run page's filters that are set, as a query's parameters."""
    return {k: v for k, v in (filters or {}).items() if v}


def _task_id(request: Request) -> str:
    """The task_id of a task address (`task_href`'s two forms)."""
    return request.path_params["task_id"] or request.query_params.get("task_id", "")


def templates() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))
    env.globals.update(
        task_href=task_href, VERDICT_FLAGS=VERDICT_FLAGS, SCORE_MAX=SCORE_RANGE[1], MAX_NOTE_CHARS=MAX_NOTE_CHARS,
        REASON_RETIRED=REASON_RETIRED, STATE_LEGACY=STATE_LEGACY,
    )  # fmt: skip
    env.filters["q"] = lambda value: quote(str(value), safe="")
    env.filters["pct"] = lambda value: "–" if value is None else f"{value:.0%}"
    env.filters["money"] = lambda value: "–" if value is None else f"${value:,.4f}"
    env.filters["n"] = lambda value: "–" if value is None else value
    env.filters["yesno"] = lambda value: {True: "yes", False: "no"}.get(value, "–")
    env.filters["json"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env


class Review:
    """The app's state: the warehouse it reads, its labels, who labels."""

    def __init__(self, root: UPath, labeler: str | None = None):
        self.warehouse = Warehouse(root)
        self.labels = Labels(root)
        self.queue = QueueMemo()
        self.labeler = labeler or os.environ.get(LABELER_ENV) or _user()
        self.env = templates()
        self.dagster_url = base_url(DAGSTER_URL_ENV)

    def html(self, name: str, status: int = 200, **context) -> HTMLResponse:
        content = self.env.get_template(name).render(
            dagster_url=self.dagster_url, fates=FATES, problem=self.warehouse.problem(), **context
        )
        return HTMLResponse(content, status_code=status)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name}={raw!r}: expected a whole number") from None
    if not low <= value <= high:
        raise BadRequest(f"{name}={value}: expected {low} to {high}")
    return value


def _filters(request: Request) -> dict:
    found = {k: request.query_params.get(k) or None for k in ("fate", "site", "macro", "reason")}
    if found["fate"] and found["fate"] not in FATES:
        raise BadRequest(f"fate={found['fate']!r}: expected one of {', '.join(FATES)}")
    return found


def _tasks_page(review: Review, request: Request) -> dict:
    run_id = request.path_params["run_id"]
    tables = review.warehouse.run(run_id)
    filters = _filters(request)
    offset = _int(request, "offset", 0, 0, 10**9)
    limit = _int(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    total, rows = page(tables.tasks, filters, offset, limit)
    return {"run_id": run_id, "total": total, "offset": offset, "limit": limit, "filters": filters, "tasks": rows}


def _runs_page(review: Review, request: Request) -> dict:
    offset = _int(request, "offset", 0, 0, 10**9)
    limit = _int(request, "limit", RUNS_PER_PAGE, 1, MAX_LIMIT)
    total, runs = review.warehouse.runs(offset, limit)
    return {"total": total, "offset": offset, "limit": limit, "runs": runs}


def _runs_href(offset: int, limit: int) -> str:
    query = {**({"offset": offset} if offset else {}), **({"limit": limit} if limit != RUNS_PER_PAGE else {})}
    return "/" + ("?" + urlencode(query) if query else "")


def runs_page(request: Request) -> Response:
    found = _runs_page(request.app.state.review, request)
    offset, limit, total = found["offset"], found["limit"], found["total"]
    pages = {
        "newer": max(0, min(offset, total) - limit) if offset else None,  # (from past the end: the last page)
        "older": offset + limit if offset + limit < total else None,
    }
    links = {k: None if at is None else _runs_href(at, limit) for k, at in pages.items()}
    return request.app.state.review.html("runs.html", links=links, **found)


def run_page(request: Request) -> Response:
    review = request.app.state.review
    found = _tasks_page(review, request)
    tables = review.warehouse.run(found["run_id"])
    choices = {c: sorted(v for v in tables.tasks[c].dropna().unique()) for c in ("site", "macro", "reason")}
    query = _query(found["filters"])
    pages = {"prev": max(0, found["offset"] - found["limit"]) if found["offset"] else None,
             "next": found["offset"] + found["limit"] if found["offset"] + found["limit"] < found["total"] else None}  # fmt: skip
    links = {k: None if v is None else "?" + urlencode({**query, "offset": v, "limit": found["limit"]})
             for k, v in pages.items()}  # fmt: skip
    rejected = tables.rejects.sort_values(["file", "line"]).head(REJECTED_LINES_SHOWN)
    return review.html("run.html", summary=tables.summary, choices=choices, links=links,
                       listing=_listing(found["filters"], found["limit"]),
                       rejected_lines=plain(rejected[["message"]].to_dict("records")),
                       page_count=max(1, ceil(found["total"] / found["limit"])), **found)  # fmt: skip


def task_page(request: Request) -> Response:
    review = request.app.state.review
    run_id, task_id = request.path_params["run_id"], _task_id(request)
    found = story(review.warehouse, run_id, task_id, review.labels.frame())
    filters = _filters(request)
    tasks = matching(review.warehouse.run(run_id).tasks, filters)["task_id"].reset_index(drop=True)
    if not (tasks == task_id).any():  # (a task outside the list it was reached from: the whole run's order)
        filters = dict.fromkeys(filters)
        tasks = review.warehouse.run(run_id).tasks["task_id"].reset_index(drop=True)
    at = int(tasks.index[tasks == task_id][0])
    near = {"prev": tasks.iloc[at - 1] if at > 0 else None, "next": tasks.iloc[at + 1] if at + 1 < len(tasks) else None}
    query, listing = _query(filters), _listing(filters, _int(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT))
    # (back to the page of the list that holds the task, which prev and next may have moved beyond the first)
    limit = listing.get("limit", DEFAULT_LIMIT)
    listed = {**_query(listing), **({"offset": at - at % limit} if at >= limit else {})}
    back = f"/runs/{quote(run_id, safe='')}" + ("?" + urlencode(listed) if listed else "")
    within = ", ".join(f"{k}={v}" for k, v in query.items())
    return review.html("task.html", s=found, near=near, filters=listing, back=back, within=within, blind=False)


def _listing(filters: dict, limit: int) -> dict:
    """The run page's filters and page size (when not the default): what a task's links carry, so that its
    previous, next and the way back stay in the same list, on the same page size."""
    return {**filters, **({"limit": limit} if limit != DEFAULT_LIMIT else {})}


def queue_page(request: Request) -> Response:
    review = request.app.state.review
    tried = set()
    while True:
        try:
            return _queue_page(review, request)
        except UnreadableRun as exc:
            # its run leaves the queue once known to be unreadable (`Warehouse.judged`): the queue goes on
            if exc.run_id in tried:
                raise
            tried.add(exc.run_id)
            review.warehouse.summary(exc.run_id)


def _queue_page(review: Review, request: Request) -> Response:
    queue, done, figures = review.queue.state(review.warehouse, review.labels.frame())
    if queue.empty:
        return review.html("queue.html", item=None, figures=figures, pos=0, total=0, s=None, blind=True)
    still_open = np.flatnonzero(~done)
    pos = _int(request, "pos", int(still_open[0]) if len(still_open) else len(queue) - 1, 0, len(queue) - 1)
    if request.query_params.get("dir"):  # (after a label: the attempt itself, wherever the label moved it)
        at = np.flatnonzero(queue["dir"].to_numpy(object) == request.query_params["dir"])
        if not len(at):
            raise ReviewError(f"no judged attempt with dir {request.query_params['dir']!r} in the queue")
        pos = int(at[0])
    current = item(queue, pos)
    blind = request.query_params.get("blind", "1") != "0" and not done[pos]
    found = story(review.warehouse, current.run_id, current.task_id, review.labels.frame())
    # the next item to label: after a label (addressed by dir), the first still open, wherever the label moved
    # this one; else the first open after it
    later = still_open[still_open != pos] if request.query_params.get("dir") else still_open[still_open > pos]
    after_label = "/queue?" + urlencode({"dir": current.dir})
    return review.html("queue.html", item=current, figures=figures, pos=pos, total=len(queue), s=found, blind=blind,
                       labelled=bool(done[pos]), remaining=len(still_open), after_label=after_label,
                       next_pos=int(later[0]) if len(later) else pos + 1)  # fmt: skip


def screenshot_file(request: Request) -> Response:
    review = request.app.state.review
    attempt = _int(request, "attempt", -1, 0, 10**9)
    content = screenshot(review.warehouse, request.path_params["run_id"], request.query_params.get("task_id", ""),
                         attempt, request.query_params.get("name", ""))  # fmt: skip
    return Response(content, media_type="image/png", headers={"Cache-Control": "private, max-age=300"})


def api_runs(request: Request) -> Response:
    return JSONResponse(_runs_page(request.app.state.review, request))


def api_tasks(request: Request) -> Response:
    return JSONResponse(_tasks_page(request.app.state.review, request))


def api_task(request: Request) -> Response:
    review = request.app.state.review
    found = story(review.warehouse, request.path_params["run_id"], _task_id(request), review.labels.frame())
    return JSONResponse(found)


async def api_labels(request: Request) -> Response:
    review = request.app.state.review
    _refuse_other_sites(request)
    try:
        body = json.loads(await _body(request, MAX_LABEL_BYTES))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadRequest("the body is not JSON: expected {dir | run_id + task_id, success, note}") from None
    record = await run_in_threadpool(label_record, review, body)
    try:
        await run_in_threadpool(append_label, review.warehouse.root, record)
    except LabelWriteError as exc:
        return _error(request, 503, one_line(exc, ERROR_MAX_CHARS))
    return JSONResponse({"label": record}, status_code=201)


def _refuse_other_sites(request: Request) -> None:
    """Labels are written only on requests a page of another site cannot make (CSRF): JSON, which a browser
    sends to another origin only after a CORS preflight this app never grants, and, where the browser says
    where the request comes from (Origin, Sec-Fetch-Site), from this app's own pages."""
    if request.headers.get("content-type", "").partition(";")[0].strip().lower() != "application/json":
        raise HTTPException(415, "expected Content-Type: application/json")
    site, origin = request.headers.get("sec-fetch-site"), request.headers.get("origin")
    if site not in (None, "same-origin", "none") or (origin is not None and not _allowed_origin(request, origin)):
        raise HTTPException(403, "labels are written from this app's own pages or by a client that is not a browser")


def _allowed_origin(request: Request, origin: str) -> bool:
    """This app's own origin, as the request names it, or one of the names it is also reached by (a reverse
    proxy's public name: the proxy may pass the app another Host and scheme than the browser's)."""
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin == own:
        return True
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return False
    # (on its scheme's default port: another port of the same name is another site)
    return parts.scheme in ("http", "https") and port is None and parts.hostname in request.app.state.also_reached_as


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) once it passes `limit` bytes."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"the body is over {limit} bytes")
    return bytes(body)


def _label_value(value) -> bool:
    """true, false or null (unsure): never 1 or 0, which equal True and False in Python."""
    return value is None or isinstance(value, bool)


def label_record(review: Review, body) -> dict:
    """The labels.jsonl line a POST asks for, in the dir form; BadRequest or ReviewError when it names no
    attempt or is malformed."""
    if not isinstance(body, dict) or "success" not in body or not _label_value(body["success"]):
        raise BadRequest('expected {"dir" | "run_id" + "task_id", "success": true | false | null, "note"}')
    note = body.get("note")
    if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE_CHARS):
        raise BadRequest(f"note: expected text of at most {MAX_NOTE_CHARS} characters")
    for name in ("dir", "run_id", "task_id", "labeler", "note"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(f"{name}: expected text")
        if isinstance(body.get(name), str) and not is_text(body[name]):
            raise BadRequest(f"{name}: expected text (it holds a lone surrogate)")
    if isinstance(body.get("dir"), str):
        dir_ = body["dir"]
        run_id, attempts = _run_with_dir(review, body, dir_)
        _same_attempt(body, dir_, run_id, set(attempts.loc[attempts["dir"] == dir_, "task_id"]))
    elif isinstance(body.get("run_id"), str) and isinstance(body.get("task_id"), str):
        dir_ = story(review.warehouse, body["run_id"], body["task_id"])["judged_dir"]
        if dir_ is None:
            raise ReviewError(f"task {body['task_id']!r} of run {body['run_id']!r} has no judged attempt")
    else:
        raise BadRequest('expected "dir", or "run_id" and "task_id", as text')
    labeler = body.get("labeler") if isinstance(body.get("labeler"), str) and body["labeler"] else review.labeler
    record = {"dir": dir_, "success": body["success"]}
    return record | ({"note": note} if note else {}) | {"labeler": labeler[:MAX_LABELER_CHARS], "labeled_at": now_iso()}


def _run_with_dir(review: Review, body: dict, dir_: str) -> tuple[str, pd.DataFrame]:
    """(the run, its attempts) of the attempt with trajectory `dir_`: in the run named beside it, else in the run
    whose folder holds it (a batch's dirs may lie anywhere in the data root); ReviewError when neither has it."""
    parts = dir_.split("/")
    folder_run = parts[1] if len(parts) > 2 and inside_run(parts[1], dir_) else None
    candidates = list(dict.fromkeys(r for r in (body.get("run_id"), folder_run) if r))
    if not candidates:
        raise ReviewError(f"no attempt with dir {dir_!r} (outside runs/<run_id>/: send its run_id too)")
    for run_id in candidates:
        try:
            attempts = review.warehouse.run(run_id).attempts
        except ReviewError:
            continue
        if (attempts["dir"] == dir_).any():
            return run_id, attempts
    raise ReviewError(f"no attempt with dir {dir_!r} in run {' or '.join(map(repr, candidates))}")


def _same_attempt(body: dict, dir_: str, run_id: str, task_ids: set[str]) -> None:
    """BadRequest when a POST naming `dir_` (an attempt of one of `task_ids` in run `run_id`) also names another
    run or task: which of the two was meant cannot be told."""
    if body.get("run_id") not in (None, run_id) or body.get("task_id") not in (None, *task_ids):
        raise BadRequest(f"dir {dir_!r} is an attempt of task {', '.join(sorted(task_ids))} of run {run_id}, not of "
                         "the run_id and task_id given: send the dir alone, or the run_id and task_id alone")  # fmt: skip


async def on_review_error(request: Request, exc: ReviewError) -> Response:
    return _error(request, 404, one_line(exc.args[0] if exc.args else "not found", ERROR_MAX_CHARS))


async def on_unreadable_file(request: Request, exc: UnreadableFile) -> Response:
    return _error(request, 500, one_line(exc, ERROR_MAX_CHARS))


async def on_bad_request(request: Request, exc: BadRequest) -> Response:
    return _error(request, 400, one_line(exc, ERROR_MAX_CHARS))


async def on_http_error(request: Request, exc: HTTPException) -> Response:
    return _error(request, exc.status_code, one_line(exc.detail, ERROR_MAX_CHARS))


async def on_any_error(request: Request, exc: Exception) -> Response:
    if trouble := store_trouble(exc):  # (the store down or refusing: the page may answer once it is back)
        return _error(request, 503, f"the data root cannot be read now ({trouble})")
    return _error(request, 500, f"internal error ({type(exc).__name__}); the server's log has the details")


def _error(request: Request, status: int, line: str) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": line}, status_code=status, headers=SECURITY_HEADERS)
    return PlainTextResponse(line + "\n", status_code=status, headers=SECURITY_HEADERS)


class SecurityHeaders:
    """Pure ASGI middleware adding SECURITY_HEADERS to every response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def sending(message):
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()
                         if k.lower().encode() not in present]  # fmt: skip
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, sending)


def create_app(
    root: UPath, labeler: str | None = None, host: str = LOOPBACK[0], allowed_hosts: tuple[str, ...] = ()
) -> Starlette:
    """The review app over the data root `root`, served on the address `host`. A request naming another host
    than that, a loopback name or one of `allowed_hosts` (the names it is also reached by: a reverse proxy's,
    this machine's on the LAN) is refused, so that a page of another site whose name was pointed at this
    machine (DNS rebinding) cannot read it or write labels; served on every address (0.0.0.0, ::), any
    name is answered."""
    routes = [
        Route("/", runs_page),
        Route("/queue", queue_page),
        Route("/runs/{run_id}", run_page),
        Route("/runs/{run_id}/screenshot", screenshot_file),
        Route("/runs/{run_id}/tasks/{task_id:path}", task_page),
        Route("/api/runs", api_runs),
        Route("/api/runs/{run_id}/tasks", api_tasks),
        Route("/api/runs/{run_id}/tasks/{task_id:path}", api_task),
        Route("/api/labels", api_labels, methods=["POST"]),
        Route("/runs", lambda request: RedirectResponse("/")),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    handlers = {ReviewError: on_review_error, BadRequest: on_bad_request, HTTPException: on_http_error,
                UnreadableFile: on_unreadable_file, Exception: on_any_error}  # fmt: skip
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.review = Review(root, labeler)
    app.state.also_reached_as = {name.lower() for name in allowed_hosts}
    named = [*LOOPBACK, host, *allowed_hosts]
    hosts = ["*"] if host in ANY_ADDRESS else [*named, *(f"[{name}]" for name in named if ":" in name)]
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)
    app.add_middleware(SecurityHeaders)  # (added last: outermost, so a refused host's answer carries them too)
    return app
