"""A real browser (Debian's headless Chromium, driven by Selenium through chromedriver) labels three queue items
by keyboard; then `judge_calibration` counts them."""

import json
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from upath import UPath

from filter_pipeline_tests.review.conftest import Served

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@pytest.fixture
def browser(monkeypatch):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(
            f"{CHROMIUM} or {CHROMEDRIVER} missing: run scripts/ensure_chromium.sh (Debian: chromium, chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager never downloads a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def calibration_of(root: Path) -> pd.DataFrame:
    from filter_pipeline.shell.assets import judge_calibration
    from filter_pipeline.shell.warehouse import DataRoot, WarehouseIOManager

    data = DataRoot(path=str(root))
    result = dg.materialize([judge_calibration], resources={"data": data, "io_manager": WarehouseIOManager(data=data)},
                            instance=dg.DagsterInstance.ephemeral())  # fmt: skip
    assert result.success
    return pd.read_parquet(root / "warehouse" / "judge_calibration.parquet")


def _wait_for(driver, condition, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; page: {driver.current_url}")
        time.sleep(0.1)


def _press(driver, key: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(key).perform()


def test_three_labels_by_keyboard_in_the_queue_are_counted_by_judge_calibration(browser, sample_root):
    judge_before = calibration_of(sample_root).set_index(["predictor", "site"]).loc[("judge", "(all)"), "n"]
    app = Served(UPath(str(sample_root)), labeler="browser")
    try:
        browser.get(app.url + "/queue")
        assert "Blind:" in browser.page_source and "Verdict:" not in browser.page_source
        labelled = []
        for key in ("y", "n", "y"):
            form = browser.find_element("css selector", "form.label-form")
            labelled.append(json.loads(form.get_attribute("data-attempt"))["dir"])
            _press(browser, key)
            # the label is saved, and the page shows the verdict of the attempt just labelled
            _wait_for(browser, lambda: "Verdict:" in browser.page_source, f"the verdict after {key!r}")
            before = browser.current_url
            _press(browser, "j")
            _wait_for(
                browser, lambda: browser.current_url != before and "Blind:" in browser.page_source, "the next item"
            )
        assert len(set(labelled)) == 3
    finally:
        app.stop()
    lines = (sample_root / "labels.jsonl").read_text().splitlines()[-3:]
    assert all('"labeler":"browser"' in line for line in lines)
    assert [line.split('"dir":"', 1)[1].split('"', 1)[0] for line in lines] == labelled
    judge_after = calibration_of(sample_root).set_index(["predictor", "site"]).loc[("judge", "(all)"), "n"]
    assert judge_after == judge_before + 3


def test_enter_in_the_note_keeps_the_item_and_a_double_press_writes_one_label(browser, sample_root):
    labels = sample_root / "labels.jsonl"
    before = labels.read_text().splitlines() if labels.exists() else []
    app = Served(UPath(str(sample_root)), labeler="browser")
    try:
        browser.get(app.url + "/queue?pos=3")
        url, form = browser.current_url, browser.find_element("css selector", "form.label-form")
        note = form.find_element("css selector", "input[name=note]")
        note.send_keys("the cart was empty\n")  # Enter: the form is not submitted
        _wait_for(browser, lambda: "to save the note" in form.text, "the line saying how to save the note")
        assert browser.current_url == url and note.get_attribute("value") == "the cart was empty"
        browser.execute_script("document.activeElement.blur()")  # (keys typed in the note are the note's)
        _press(browser, "ny")  # two presses, the second while the first is being saved: it is ignored
        _wait_for(browser, lambda: "Verdict:" in browser.page_source, "the verdict after the label")
    finally:
        app.stop()
    [added] = labels.read_text().splitlines()[len(before) :]
    assert '"success":false' in added and '"note":"the cart was empty"' in added


def test_a_page_the_back_button_restores_after_a_label_takes_another(browser, sample_root):
    app = Served(UPath(str(sample_root)), labeler="browser")
    try:
        browser.get(app.url + "/queue?pos=2")
        _press(browser, "y")
        _wait_for(browser, lambda: "Verdict:" in browser.page_source, "the verdict after the label")
        browser.back()  # (restored from the back/forward cache, or loaded again: labelling works either way)
        _wait_for(browser, lambda: "Blind:" in browser.page_source, "the item again")
        buttons = browser.find_elements("css selector", "form.label-form button")
        assert buttons and not any(b.get_attribute("disabled") for b in buttons)
    finally:
        app.stop()


def test_ids_holding_a_carriage_return_or_a_nul_are_labelled_as_they_are(browser, cli, data_root):
    from urllib.parse import quote

    from filter_pipeline_tests.builders import attempt, task, write_batch

    odd = ["cr\rx", "nul\x00x", "crlf\r\nx"]  # (an HTML attribute would turn a CR into a LF, a NUL into U+FFFD)
    write_batch(data_root, "r", [task(t) for t in odd], [attempt(t) for t in odd])
    assert cli(env={"FILTER_JUDGE_KIND": "gate"}).returncode == 0
    app = Served(UPath(str(data_root)), labeler="browser")
    try:
        for task_id in odd:
            browser.get(f"{app.url}/runs/r/tasks/?task_id={quote(task_id, safe='')}")
            _press(browser, "y")
            _wait_for(browser, lambda: "success by browser" in browser.page_source, f"the label of {task_id!r}")
    finally:
        app.stop()
    labels = [json.loads(line) for line in (data_root / "labels.jsonl").read_text().splitlines()]
    assert [label["dir"] for label in labels] == [f"runs/r/traj/{t}/1" for t in odd]
