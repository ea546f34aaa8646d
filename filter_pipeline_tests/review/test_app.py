"""The review app over HTTP, served by a real uvicorn on loopback over the filtered sample."""

import json
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import pandas as pd
import pytest
from upath import UPath

from filter_pipeline.review.data import Warehouse
from filter_pipeline.review.queue import QueueMemo
from filter_pipeline.rules.calibration import parse_labels
from filter_pipeline_tests.review.conftest import HOSTILE_TASK, PNG, SCRIPT, Served
from filter_pipeline_tests.review.small_warehouse import write_run

pytestmark = pytest.mark.slow


def get(served, path: str) -> tuple[int, dict, str]:
    try:
        with urllib.request.urlopen(served.url + path, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode("utf-8", "replace")


def post(served, body, raw: bytes | None = None, headers: dict | None = None) -> tuple[int, str]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(served.url + "/api/labels", data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def form_attempt(html: str) -> dict:
    """The attempt a page's label form labels (its `data-attempt`: dir, run_id, task_id)."""
    return json.loads(html.split("data-attempt='", 1)[1].split("'", 1)[0])


def test_every_page_answers_with_a_strict_content_security_policy(served):
    for path in ["/", "/runs/2026-11-28", "/runs/2026-11-29?fate=surplus&site=maps.example",
                 f"/runs/2026-11-28/tasks/{HOSTILE_TASK}", "/queue", "/queue?pos=3&blind=0", "/runs/2026-11-27",
                 "/static/review.js", "/static/review.css"]:  # fmt: skip
        status, headers, body = get(served, path)
        assert status == 200, (path, body)
        csp = headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
        assert headers["x-content-type-options"] == "nosniff"
        if path.startswith("/static"):
            continue
        assert "<script>" not in body.replace('<script src="/static/review.js" defer></script>', ""), path


def test_runs_page_and_api_show_state_funnel_and_rates(served):
    status, _, body = get(served, "/api/runs")
    runs = {r["run_id"]: r for r in json.loads(body)["runs"]}
    assert status == 200 and set(runs) == {"2026-11-27", "2026-11-28", "2026-11-29"}
    r29 = runs["2026-11-29"]
    assert (r29["state"], r29["tasks"], r29["kept"], r29["surplus"], r29["execute_fail"]) == ("committed", 14, 1, 9, 4)
    assert r29["surplus_by_reason"] == {"duplicate": 6, "site_cap": 3, "target": 0}
    assert r29["judge_pass_rate"] == 1.0 and abs(r29["keep_rate"] - 1 / 14) < 1e-9
    legacy = runs["2026-11-27"]
    assert (legacy["state"], legacy["kept"], legacy["tasks"], legacy["keep_rate"]) == ("legacy", 5, None, None)
    unknown = ["judged", "surplus", "judge_fail", "unjudged", "execute_fail", "reject", "rejects", "attempts"]
    assert [legacy[k] for k in unknown] == [None] * len(unknown)  # (only its kept rows are known: not 0)
    _, _, page = get(served, "/runs/2026-11-27")
    assert "kept: 5</a>" in page and "surplus: –</a>" in page and "None" not in page
    _, _, page = get(served, "/runs/2026-11-27")
    assert "Filtered by the earlier script: its <code>kept.jsonl</code> holds the 5 kept rows below" in page
    _, _, html = get(served, "/")
    assert '<a href="/runs/2026-11-29">2026-11-29</a>' in html and "committed" in html


def test_the_rejected_lines_of_a_run_are_counted_on_the_runs_page_and_listed_on_its_page(served):
    _, _, runs = get(served, "/")
    row = runs[runs.rindex("<tr>", 0, runs.index('<a href="/runs/2026-11-29">')) :].split("</tr>")[0]
    cells = [cell.split(">", 1)[1].split("</td>")[0] for cell in row.split("<td")[1:]]
    assert cells[9:11] == ["0", "2"]  # no task line rejected (reject), two lines of executions.jsonl
    _, _, html = get(served, "/runs/2026-11-29")
    assert "2 rejected lines of the batch's files" in html
    assert "<li>executions.jsonl:25: line is not JSON (Expecting value at column 1)</li>" in html
    assert "<li>executions.jsonl:26: attempt of task_id &#39;ghost&#39; which is not in tasks.jsonl</li>" in html


def test_task_table_is_filtered_and_paged_on_the_server(served):
    _, _, body = get(served, "/api/runs/2026-11-29/tasks?fate=surplus&limit=4")
    found = json.loads(body)
    assert found["total"] == 9 and len(found["tasks"]) == 4 and {t["fate"] for t in found["tasks"]} == {"surplus"}
    _, _, rest = get(served, "/api/runs/2026-11-29/tasks?fate=surplus&limit=4&offset=8")
    assert len(json.loads(rest)["tasks"]) == 1
    _, _, dup = get(served, "/api/runs/2026-11-29/tasks?reason=duplicate&site=maps.example")
    assert {(t["reason"], t["site"]) for t in json.loads(dup)["tasks"]} == {("duplicate", "maps.example")}
    _, _, html = get(served, "/runs/2026-11-29?fate=surplus&limit=4")
    assert "9 tasks match" in html and 'id="next"' in html


def test_from_a_filtered_list_previous_and_next_stay_in_it(served):
    _, _, body = get(served, "/api/runs/2026-11-29/tasks?fate=surplus")
    surplus = [t["task_id"] for t in json.loads(body)["tasks"]]
    _, _, listing = get(served, "/runs/2026-11-29?fate=surplus")
    assert f'href="/runs/2026-11-29/tasks/{surplus[1]}?fate=surplus"' in listing
    _, _, html = get(served, f"/runs/2026-11-29/tasks/{surplus[1]}?fate=surplus")
    assert f'id="prev" href="/runs/2026-11-29/tasks/{surplus[0]}?fate=surplus"' in html
    assert f'id="next" href="/runs/2026-11-29/tasks/{surplus[2]}?fate=surplus"' in html
    assert 'id="list" href="/runs/2026-11-29?fate=surplus">back to the list (fate=surplus)' in html
    _, _, whole = get(served, "/api/runs/2026-11-29/tasks?limit=1000")
    everything = [t["task_id"] for t in json.loads(whole)["tasks"]]
    at = everything.index(surplus[1])
    _, _, unfiltered = get(served, f"/runs/2026-11-29/tasks/{surplus[1]}")
    assert f'id="next" href="/runs/2026-11-29/tasks/{everything[at + 1]}"' in unfiltered


def test_task_story_has_attempts_verdict_decision_and_labels(served):
    status, _, body = get(served, "/api/runs/2026-11-29/tasks/2026-11-29-t004")
    story = json.loads(body)
    assert status == 200 and story["decision"]["duplicate_of"] == {"run_id": "2026-11-28", "task_id": "2026-11-28-t000"}
    assert story["verdict"]["passed"] is True and story["trajectory"]["final_url"] == "https://maps.example/done"
    _, _, html = get(served, "/runs/2026-11-29/tasks/2026-11-29-t004")
    assert 'href="/runs/2026-11-28/tasks/2026-11-28-t000"' in html and "Duplicate of" in html
    _, _, failed = get(served, "/api/runs/2026-11-28/tasks/2026-11-28-t013")
    failed = json.loads(failed)
    assert failed["task"]["fate"] == "execute_fail" and [a["failure"]["reason"] for a in failed["attempts"]] == [
        "action_refused", "backend_fail"]  # fmt: skip
    assert [label["success"] for label in failed["labels"]] == [False, False]


def test_page_text_with_a_script_is_shown_as_text(served):
    _, _, html = get(served, f"/runs/2026-11-28/tasks/{HOSTILE_TASK}")
    assert SCRIPT not in html
    assert "&lt;script&gt;document.title=&#39;owned&#39;&lt;/script&gt;" in html


def test_screenshots_are_served_only_from_the_runs_trajectory_folders(served):
    base = f"/runs/2026-11-28/screenshot?task_id={HOSTILE_TASK}&attempt=1"
    status, headers, _ = get(served, base + "&name=step-1.png")
    assert status == 200 and headers["content-type"] == "image/png"
    with urllib.request.urlopen(served.url + base + "&name=step-1.png") as response:
        assert response.read() == PNG
    _, _, html = get(served, f"/runs/2026-11-28/tasks/{HOSTILE_TASK}")
    assert "name=step-1.png" in html
    for name in ["../../../../../secret.txt", quote("../../../../../secret.txt", safe=""), "leak.png",
                 "..%2F..%2Flabels.jsonl", "/etc/passwd", "trajectory.json"]:  # fmt: skip
        status, _, body = get(served, base + f"&name={name}")
        assert status == 404 and "do not serve me" not in body and len(body.splitlines()) == 1, name
    status, _, body = get(served, "/runs/..%2F..%2F/screenshot?task_id=x&attempt=1&name=a.png")
    assert status == 404 and len(body.splitlines()) == 1
    status, _, _ = get(served, "/static/..%2F..%2Fdata.py")
    assert status == 404


def test_every_screenshot_the_judge_takes_is_listed_and_served_and_nothing_else(served, sample_root):
    from filter_pipeline.judge.prompt import screenshot_files

    folder = sample_root / "runs" / "2026-11-28" / "traj" / HOSTILE_TASK / "1"
    for name in ("b c.png", "ü.png", ".hidden.png"):
        (folder / name).write_bytes(PNG + name.encode())
    (folder / "x.png").mkdir()  # a folder, not a screenshot
    (sample_root / "shared.png").write_bytes(PNG + b"shared")
    (folder / "in-root.png").symlink_to(sample_root / "shared.png")  # elsewhere in the data root: taken
    judge_takes = [p.name for p in screenshot_files(UPath(str(sample_root)), UPath(str(folder)))]
    assert judge_takes == [".hidden.png", "b c.png", "in-root.png", "step-1.png", "ü.png"]
    _, _, body = get(served, f"/api/runs/2026-11-28/tasks/{HOSTILE_TASK}")
    assert json.loads(body)["trajectory"]["screenshots"] == judge_takes
    base = f"/runs/2026-11-28/screenshot?task_id={HOSTILE_TASK}&attempt=1&name="
    for name in judge_takes:
        with urllib.request.urlopen(served.url + base + quote(name)) as response:
            assert response.read().startswith(PNG), name
    for name in ("x.png", "leak.png", "trajectory.json", "../../../../../shared.png"):
        status, _, body = get(served, base + quote(name))
        assert status == 404 and "do not serve me" not in body, name


def test_bad_ids_and_requests_get_one_line_4xx(served):
    for path, code in [("/runs/nope", 404), ("/runs/2026-11-28/tasks/nope", 404), ("/api/runs/nope/tasks", 404),
                       ("/api/runs/2026-11-28/tasks/nope", 404), ("/api/runs/2026-11-28/tasks?offset=-1", 400),
                       ("/api/runs/2026-11-28/tasks?limit=abc", 400), ("/api/runs/2026-11-28/tasks?fate=lost", 400),
                       ("/queue?pos=99999", 400), ("/no/such/page", 404)]:  # fmt: skip
        status, _, body = get(served, path)
        assert status == code and len(body.strip().splitlines()) == 1 and "Traceback" not in body, (path, body)
    for body, raw in [(None, b"not json"), ({"success": True}, None), ({"dir": "runs/2026-11-28/x", "success": True}, None),
                      ({"dir": "runs/../../etc", "success": True}, None), ({"run_id": "nope", "task_id": "t", "success": True}, None),
                      ({"run_id": "2026-11-28", "task_id": "2026-11-28-t013", "success": True}, None),
                      ({"dir": "runs/2026-11-28/traj/2026-11-28-t001/1", "success": "yes"}, None), ([1], None),
                      ({"dir": "runs/2026-11-28/traj/2026-11-28-t001/1", "success": 1}, None)]:  # fmt: skip
        status, text = post(served, body, raw)
        assert 400 <= status < 500 and len(text.strip().splitlines()) == 1 and "Traceback" not in text, (body, text)


LABEL = {"dir": "runs/2026-11-28/traj/2026-11-28-t001/1", "success": True}


def test_a_label_post_another_site_could_make_is_refused_and_writes_nothing(served, sample_root):
    before = (sample_root / "labels.jsonl").read_bytes()
    form = urllib.parse.urlencode({json.dumps(LABEL): ""}).encode()
    for headers, raw, code in [
        ({"Content-Type": "text/plain"}, None, 415),  # what an HTML form on any page can send
        ({"Content-Type": "application/x-www-form-urlencoded"}, form, 415),
        ({"Origin": "http://evil.example"}, None, 403),  # a page of another site, its JSON preflight granted
        ({"Origin": "null"}, None, 403),
        ({"Sec-Fetch-Site": "cross-site"}, None, 403),
        ({"Host": "rebound.example:8765"}, None, 400),  # another site's name pointed at this machine
    ]:
        status, text = post(served, LABEL, raw, headers)
        assert status == code and len(text.strip().splitlines()) == 1, (headers, text)
        assert get_with(served, "/api/runs", headers)[0] == (400 if "Host" in headers else 200)
    assert (sample_root / "labels.jsonl").read_bytes() == before
    own = {"Origin": served.url, "Sec-Fetch-Site": "same-origin"}  # this app's own page, as a browser sends it
    assert post(served, LABEL, headers=own)[0] == 201
    assert post(served, LABEL, headers={"Host": f"localhost:{served.port}"})[0] == 201


def test_the_app_answers_its_loopback_names_and_the_names_it_is_allowed(sample_root):
    from upath import UPath

    from filter_pipeline_tests.review.conftest import Served

    app = Served(UPath(str(sample_root)), allowed_hosts=("review.example.com",))
    try:
        for host, code in [(f"[::1]:{app.port}", 200), (f"localhost:{app.port}", 200), ("review.example.com", 200),
                           ("other.example.com", 400)]:  # fmt: skip
            assert get_with(app, "/api/runs", {"Host": host})[0] == code, host
        # behind a proxy that passes the app its own address, the browser's origin is the public name
        proxied = {"Origin": "https://review.example.com", "Sec-Fetch-Site": "same-origin"}
        assert post(app, LABEL, headers=proxied)[0] == 201
        for other in ("https://other.example.com", "http://review.example.com:9999"):  # another site, or port
            assert post(app, LABEL, headers={"Origin": other})[0] == 403
    finally:
        app.stop()


def get_with(served, path: str, headers: dict) -> tuple[int, str]:
    request = urllib.request.Request(served.url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_label_post_too_large_too_deep_or_not_unicode_is_a_one_line_4xx(served, sample_root):
    before = (sample_root / "labels.jsonl").read_bytes()
    for body, raw, code in [
        (None, json.dumps({**LABEL, "pad": "x" * 100_000}).encode(), 413),
        (None, b"[" * 20_000 + b"]" * 20_000, 400),  # deeper than json follows
        (None, json.dumps({**LABEL, "note": "\ud83d"}).encode(), 400),  # a lone surrogate, as JSON escapes it
        (None, json.dumps({**LABEL, "labeler": "\udc00"}).encode(), 400),
        (None, json.dumps({**LABEL, "labeler": 5}).encode(), 400),
        (None, json.dumps({**LABEL, "dir": "runs/2026-11-29/\ud83d/x"}).encode(), 400),
        (None, json.dumps({"run_id": "2026-11-29", "task_id": "\ud83d", "success": True}).encode(), 400),
        ({**LABEL, "run_id": "2026-11-29", "task_id": "2026-11-29-t004"}, None, 400),  # which attempt is meant?
        ({"dir": 5, "run_id": "2026-11-29", "task_id": "2026-11-29-t004", "success": True}, None, 400),  # not ignored
    ]:
        status, text = post(served, body, raw)
        assert status == code and len(text.strip().splitlines()) == 1 and "Traceback" not in text, text
    assert (
        "note: expected text (it holds a lone surrogate)"
        in post(served, None, json.dumps({**LABEL, "note": "\ud83d"}).encode())[1]
    )
    assert (sample_root / "labels.jsonl").read_bytes() == before


def test_labels_are_appended_in_the_coordination_format_and_counted_by_calibration(served, sample_root):
    before = (sample_root / "labels.jsonl").read_bytes()
    assert post(served, {"run_id": "2026-11-29", "task_id": "2026-11-29-t004", "success": True, "note": "ok"})[0] == 201
    assert post(served, {"dir": "runs/2026-11-28/traj/2026-11-28-t001/2", "success": None})[0] == 201
    agreeing = {"dir": "runs/2026-11-28/traj/2026-11-28-t001/1", "run_id": "2026-11-28", "task_id": "2026-11-28-t001"}
    assert post(served, {**agreeing, "success": False})[0] == 201  # (the dir and the task agree)
    added = (sample_root / "labels.jsonl").read_bytes()[len(before) :].decode().splitlines()
    first, second, third = (json.loads(line) for line in added)
    assert third["dir"] == agreeing["dir"] and third["success"] is False
    assert first["dir"] == "runs/2026-11-29/traj/2026-11-29-t004/1" and first["success"] is True
    assert first["note"] == "ok" and first["labeler"] == "tester" and first["labeled_at"].endswith("Z")
    assert second["success"] is None
    labels, rejects = parse_labels((sample_root / "labels.jsonl").read_bytes())
    assert "runs/2026-11-29/traj/2026-11-29-t004/1" in set(labels["dir"])


def test_concurrent_label_posts_lose_none(served, sample_root):
    dirs = [f"runs/2026-11-28/traj/2026-11-28-t00{i}/1" for i in (1, 2, 4, 5)]
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda i: post(served, {"dir": dirs[i % 4], "success": i % 2 == 0,
                                                         "note": f"n{i}"})[0], range(80)))  # fmt: skip
    assert statuses == [201] * 80
    lines = [json.loads(line) for line in (sample_root / "labels.jsonl").read_text().splitlines() if '"note"' in line]
    assert sorted(line["note"] for line in lines) == sorted(f"n{i}" for i in range(80))


def test_the_queue_is_blind_until_labelled_and_shows_the_precision_interval(served):
    _, _, html = get(served, "/queue")
    assert "Blind:" in html and "Verdict:" not in html and "The walk&#39;s decision" not in html
    assert "95% interval" in html and "16 label lines" in html
    form_dir = form_attempt(html)["dir"]
    after_label = html.split('data-after="', 1)[1].split('"', 1)[0].replace("&amp;", "&")
    assert post(served, {"dir": form_dir, "success": True})[0] == 201
    _, _, after = get(served, after_label)  # where the page goes once the label is saved
    assert form_attempt(after)["dir"] == form_dir  # the attempt just labelled, wherever the label moved it
    assert "Verdict:" in after and "Blind:" not in after and "17 label lines" in after
    assert "random sample (the unbiased estimate)" in after
    assert get(served, "/queue?dir=runs/nope")[0] == 404


def test_a_sample_with_no_label_in_order_says_why_its_precision_is_not_there_yet(served, monkeypatch):
    from filter_pipeline.review import queue

    monkeypatch.setattr(queue, "SAMPLE_SIZE", 0)  # (no sample: the labels count on every labelled attempt only)
    _, _, html = get(served, "/queue")
    said = html.split("random sample (the unbiased estimate): ", 1)[1]
    assert said.startswith("none yet (it counts the sample's labels from its first item") and "95% interval" in said


def test_after_a_label_that_moves_its_attempt_the_next_to_label_is_the_first_still_open(served, monkeypatch):
    from filter_pipeline.review import queue

    monkeypatch.setattr(queue, "SAMPLE_SIZE", 0)  # past the sample: a label moves its site's attempts on
    _, _, html = get(served, "/queue")
    first_open = int(html.split("Item ", 1)[1].split(" ", 1)[0]) - 1
    form_dir = form_attempt(html)["dir"]
    after_label = html.split('data-after="', 1)[1].split('"', 1)[0].replace("&amp;", "&")
    assert post(served, {"dir": form_dir, "success": True})[0] == 201
    _, _, after = get(served, after_label)
    moved_to = int(after.split("Item ", 1)[1].split(" ", 1)[0]) - 1
    assert form_attempt(after)["dir"] == form_dir and moved_to > first_open
    _, _, fresh = get(served, "/queue")  # the first item still to label, in the order as it is now
    still_first = int(fresh.split("Item ", 1)[1].split(" ", 1)[0]) - 1
    assert still_first < moved_to and f'id="next" href="/queue?pos={still_first}"' in after


def test_run_page_links_to_dagster_when_its_url_is_set(monkeypatch, sample_root):
    from upath import UPath

    from filter_pipeline_tests.review.conftest import Served

    monkeypatch.setenv("FILTER_PIPELINE_DAGSTER_URL", "http://127.0.0.1:3000/")
    app = Served(UPath(str(sample_root)))
    try:
        _, _, html = get(app, "/runs/2026-11-29")
    finally:
        app.stop()
    assert 'href="http://127.0.0.1:3000/assets/kept?view=partitions&amp;partition=2026-11-29"' in html


def test_the_api_never_shows_the_judge_api_key(served, monkeypatch):
    monkeypatch.setenv("FILTER_JUDGE_API_KEY", "sk-never-shown")
    for path in ["/", "/api/runs", "/api/runs/2026-11-28/tasks/2026-11-28-t001", "/queue"]:
        assert "sk-never-shown" not in get(served, path)[2]


def test_over_s3_pages_answer_and_concurrent_label_posts_lose_none(filtered_sample, s3_server, s3_bucket):
    from upath import UPath

    from filter_pipeline.storage.files import open_root
    from filter_pipeline_tests.review.conftest import Served

    fs = s3_server.filesystem()
    for name in ("runs", "warehouse"):
        fs.put(f"{filtered_sample / name}/", f"{s3_bucket}/filter/{name}/", recursive=True)
    fs.put(str(filtered_sample / "labels.jsonl"), f"{s3_bucket}/filter/labels.jsonl")
    fs.pipe(f"{s3_bucket}/filter/runs/README.md", b"not a run")
    fs.pipe(f"{s3_bucket}/filter/runs/2026-11-30/tasks.jsonl", b"")  # being written: no _SUCCESS yet
    app = Served(open_root(f"s3://{s3_bucket}/filter", s3_server.endpoint))
    try:
        runs = json.loads(get(app, "/api/runs")[2])["runs"]
        assert [(r["run_id"], r["state"]) for r in runs] == [
            ("2026-11-30", "incomplete"),
            ("2026-11-29", "committed"),
            ("2026-11-28", "committed"),
            ("2026-11-27", "legacy"),
        ]
        status, _, body = get(app, "/api/runs/2026-11-29/tasks?fate=kept")
        assert status == 200 and json.loads(body)["total"] == 1
        assert get(app, "/runs/2026-11-29/tasks/2026-11-29-t004")[0] == 200
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda i: post(app, {"dir": "runs/2026-11-28/traj/2026-11-28-t001/2",
                                                          "success": True, "note": f"s{i}"})[0], range(24)))  # fmt: skip
    finally:
        app.stop()
    assert statuses == [201] * 24
    text = UPath(f"s3://{s3_bucket}/filter/labels.jsonl", endpoint_url=s3_server.endpoint).read_text()
    notes = [json.loads(line).get("note") for line in text.splitlines()]
    assert sorted(n for n in notes if n) == sorted(f"s{i}" for i in range(24)) and len(notes) == 16 + 24


def test_filter_reports_materialization_links_to_the_runs_review_page(filtered_sample):
    import dagster as dg

    home = filtered_sample.parent / "dagster_home"
    with dg.DagsterInstance.from_config(str(home)) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("filter_report"))
    materialization = event.asset_materialization
    assert materialization.metadata["review"].url == f"http://review.test:8765/runs/{materialization.partition}"


def test_the_review_link_is_set_only_with_its_url(monkeypatch):
    from filter_pipeline.settings import REVIEW_URL_ENV, review_run_url

    monkeypatch.delenv(REVIEW_URL_ENV, raising=False)
    assert review_run_url("r1") is None
    monkeypatch.setenv(REVIEW_URL_ENV, "https://review.example/team/")
    assert review_run_url("2026-11-28") == "https://review.example/team/runs/2026-11-28"
    assert review_run_url("a b/c") == "https://review.example/team/runs/a%20b%2Fc"


@pytest.mark.parametrize("task_id", ["..", ".", "line\nbreak", "a/../b"])
def test_a_task_opens_from_its_link_whatever_its_task_id(tmp_path, task_id):
    import html
    import re

    from upath import UPath

    from filter_pipeline_tests.review.conftest import Served

    filtered_batch(tmp_path, ["first", task_id, "last"])
    app = Served(UPath(str(tmp_path)))
    try:
        pages = {"run": "/runs/r1", "previous": f"/runs/r1/tasks/{quote('last', safe='')}",
                 "next": f"/runs/r1/tasks/{quote('first', safe='')}"}  # fmt: skip
        for name, page in pages.items():
            links = [html.unescape(h) for h in re.findall(r'href="([^"]*)"', get(app, page)[2])]
            [link] = [h for h in links if "/tasks/" in h and "first" not in h and "last" not in h]
            followed = urllib.parse.urljoin(app.url + page, link)  # (as a browser resolves it: dot segments too)
            status, _, body = get(app, followed.removeprefix(app.url))
            assert status == 200 and f"<h2>Task {html.escape(task_id)} " in body, (name, link)
        status, _, body = get(app, "/api/runs/r1/tasks/?" + urllib.parse.urlencode({"task_id": task_id}))
        assert status == 200 and json.loads(body)["task"]["task_id"] == task_id
    finally:
        app.stop()


def test_a_retired_json_the_stage_refuses_is_said_above_every_page_and_labelling_goes_on(sample_root):
    from upath import UPath

    from filter_pipeline_tests.review.conftest import Served

    (sample_root / "retired.json").write_text("{")
    app = Served(UPath(str(sample_root)))
    try:
        for path in ["/", "/runs/2026-11-28", "/runs/2026-11-28/tasks/2026-11-28-t013", "/queue"]:
            status, _, body = get(app, path)
            assert status == 200 and '<p class="problem" role="alert">retired.json is not valid JSON' in body, path
        assert post(app, LABEL)[0] == 201
    finally:
        app.stop()


def test_a_labels_file_that_cannot_be_read_is_a_one_line_500_not_a_page_without_labels(sample_root):
    from upath import UPath

    from filter_pipeline_tests.review.conftest import Served

    (sample_root / "labels.jsonl").unlink(missing_ok=True)
    (sample_root / "labels.jsonl").mkdir()
    app = Served(UPath(str(sample_root)))
    try:
        for path in ["/runs/2026-11-28/tasks/2026-11-28-t013", "/api/runs/2026-11-28/tasks/2026-11-28-t013", "/queue"]:
            status, _, body = get(app, path)
            assert status == 500 and "labels.jsonl cannot be read (Is a directory)" in body, (path, body)
            assert "Traceback" not in body and len(body.strip().splitlines()) == 1
        assert get(app, "/runs/2026-11-28")[0] == 200  # (a run's page reads no labels)
    finally:
        app.stop()


def test_an_object_store_out_of_reach_is_a_one_line_503_naming_it(monkeypatch):
    from upath import UPath

    from filter_pipeline_tests.review.conftest import Served
    from filter_pipeline_tests.servers import free_port

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    root = UPath("s3://bucket/data", endpoint_url=endpoint, use_listings_cache=False,
                 config_kwargs={"retries": {"max_attempts": 1}})  # fmt: skip
    app = Served(root)
    try:
        for path in ["/", "/api/runs"]:
            status, _, body = get(app, path)
            assert status == 503 and "the data root cannot be read now (EndpointConnectionError" in body, body
            assert endpoint in body and "Traceback" not in body
    finally:
        app.stop()


def filtered_batch(root, task_ids: list[str]) -> None:
    """Batch r1 of these tasks, one attempt each, filtered by `filter_job` with the gate judge."""
    import dagster as dg

    from filter_pipeline.judge.resource import JudgeResource
    from filter_pipeline_tests.builders import Pipeline, attempt, task, write_batch

    write_batch(root, "r1", [task(t) for t in task_ids], [attempt(t) for t in task_ids])
    with dg.DagsterInstance.ephemeral() as instance:
        Pipeline(root, instance).run(JudgeResource())


def test_back_to_the_list_returns_to_the_page_that_holds_the_task(tmp_path):
    import html

    from upath import UPath

    from filter_pipeline.review.app import DEFAULT_LIMIT
    from filter_pipeline_tests.review.conftest import Served

    filtered_batch(tmp_path, [f"t{i:03d}" for i in range(DEFAULT_LIMIT + 20)])
    app = Served(UPath(str(tmp_path)))
    try:
        for at, back in [(5, "/runs/r1?macro=m"), (DEFAULT_LIMIT + 5, f"/runs/r1?macro=m&amp;offset={DEFAULT_LIMIT}")]:
            status, _, body = get(app, f"/runs/r1/tasks/t{at:03d}?macro=m")
            assert status == 200 and f'id="list" href="{back}"' in body, at
            status, _, body = get(app, html.unescape(back))
            assert status == 200 and f'href="/runs/r1/tasks/t{at:03d}?macro=m"' in body, at
        # on a page size of its own, the list's links carry it, and so does the way back
        status, _, body = get(app, "/runs/r1?macro=m&limit=50&offset=50")
        assert status == 200 and 'href="/runs/r1/tasks/t055?macro=m&amp;limit=50"' in body
        status, _, body = get(app, "/runs/r1/tasks/t055?macro=m&limit=50")
        assert 'id="list" href="/runs/r1?macro=m&amp;limit=50&amp;offset=50"' in body
        assert 'id="next" href="/runs/r1/tasks/t056?macro=m&amp;limit=50"' in body
    finally:
        app.stop()


def test_an_attempt_whose_dir_lies_outside_its_runs_folder_is_labelled_with_its_run_named(tmp_path):
    from upath import UPath

    from filter_pipeline.review.app import Review, label_record
    from filter_pipeline.review.data import ReviewError
    from filter_pipeline_tests.review.small_warehouse import write_asset, write_run

    write_run(tmp_path, "r1")
    write_asset(tmp_path, "batch_attempts", "r1", [{"task_id": "k", "attempt": 1, "ok": True, "run_id": "r1",
                                                   "dir": "shared/traj/k/1", "n_actions": 2}])  # fmt: skip
    review = Review(UPath(str(tmp_path)), "tester")
    asked = {"dir": "shared/traj/k/1", "success": True}
    assert (
        label_record(review, {**asked, "run_id": "r1", "task_id": "k"})["dir"] == "shared/traj/k/1"
    )  # (the page's form)
    with pytest.raises(ReviewError, match="outside runs/<run_id>/: send its run_id too"):
        label_record(review, asked)
    with pytest.raises(ReviewError, match="no attempt with dir 'shared/traj/k/2' in run 'r1'"):
        label_record(review, {**asked, "dir": "shared/traj/k/2", "run_id": "r1"})
    # a dir in another run's folder (r2's attempt kept its trajectory under r1's): found in the run named
    write_run(tmp_path, "r2")
    write_asset(tmp_path, "batch_attempts", "r2", [{"task_id": "k", "attempt": 1, "ok": True, "run_id": "r2",
                                                   "dir": "runs/r1/elsewhere/k/1", "n_actions": 2}])  # fmt: skip
    record = label_record(review, {"dir": "runs/r1/elsewhere/k/1", "run_id": "r2", "task_id": "k", "success": False})
    assert record["dir"] == "runs/r1/elsewhere/k/1"


def test_the_runs_page_shows_a_page_of_runs_newest_first_with_links_to_the_others(tmp_path):
    for run_id in ("r1", "r2", "r3"):
        write_run(tmp_path, run_id)
    app = Served(UPath(str(tmp_path)))
    try:
        _, _, first = get(app, "/?limit=2")
        assert first.index(">r3<") < first.index(">r2<") and ">r1<" not in first and "3 runs, newest first" in first
        older = first.split('id="older" href="', 1)[1].split('"', 1)[0].replace("&amp;", "&")
        assert older == "/?offset=2&limit=2" and 'id="newer"' not in first
        _, _, last = get(app, older)
        assert ">r1<" in last and ">r2<" not in last and 'id="older"' not in last and 'href="/?limit=2"' in last
        status, _, body = get(app, "/api/runs?offset=1&limit=1")
        found = json.loads(body)
        assert status == 200 and found["total"] == 3 and [r["run_id"] for r in found["runs"]] == ["r2"]
        _, _, everything = get(app, "/")  # (fewer runs than a page: no page line)
        assert all(f">{r}<" in everything for r in ("r1", "r2", "r3")) and "newest first" not in everything
    finally:
        app.stop()


def test_the_queue_leaves_out_a_run_it_finds_unreadable_and_goes_on(tmp_path):
    write_run(tmp_path, "r1")
    write_run(tmp_path, "r2")
    broken = tmp_path / "warehouse" / "dpo_pairs" / "r2.parquet"  # (its verdicts read well: the queue lists them)
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_bytes(b"PAR1 cut short")
    labels = pd.DataFrame(columns=["dir", "run_id", "task_id", "success", "line"])
    before = QueueMemo().state(Warehouse(UPath(str(tmp_path))), labels)[0]
    assert len(before) == 8 and "r2" in set(before["run_id"][:4])  # (r2 is met among the first four)
    app = Served(UPath(str(tmp_path)))  # (nothing read yet: the queue first meets r2 when it shows one of its attempts)
    try:
        shown = []
        for pos in range(4):
            status, _, html = get(app, f"/queue?pos={pos}")
            assert status == 200, html
            shown.append(form_attempt(html)["dir"])
        assert {d.split("/")[1] for d in shown} == {"r1"} and len(set(shown)) == 4  # r1's four judged attempts
        assert get(app, "/queue?pos=4")[0] == 400  # (the queue holds them alone now)
    finally:
        app.stop()
