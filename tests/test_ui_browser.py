"""``amk ui`` in a real headless Chromium (Debian's chromium + chromium-driver, Selenium).

Against a directory made by short sim searches: every page loads, the trials table has one
row per trial, the trace view draws one box per task, approving a held proposal in the
browser lets ``amk search --approve`` go on and finish, a rejected trial's witness is marked
in its text IR, and an unsafe edit in the editor shows the validator's witness.

Skipped (with the reason) when chromium, chromedriver or selenium are missing, unless
AMK_REQUIRE_BROWSER=1 (CI sets it): then they fail. AMK_UI_SCREENSHOTS=DIR keeps a PNG of each
page in DIR (docs/ui/ holds the ones docs/ui.md shows).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.test_ui import Server, make_search

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"


def _need_browser() -> None:
    missing = [p for p in (CHROMIUM, DRIVER) if not os.path.exists(p)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (pip install -e '.[dev]')")
    if missing:
        why = ("the browser tests need " + ", ".join(missing)
               + " (apt-get install chromium chromium-driver)")
        if os.environ.get("AMK_REQUIRE_BROWSER") == "1":
            pytest.fail(why + "; AMK_REQUIRE_BROWSER=1 makes that a failure")
        pytest.skip(why)


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """(root, server, screenshot dir): a finished knob search, a schedule file and a trace
    file, served. The tests need no order among themselves (pytest-xdist may split them)."""
    _need_browser()
    root = tmp_path_factory.mktemp("uib")
    knobs = make_search(root / "knobs")
    (root / "traces").mkdir()
    shutil.copy(ROOT / "bench" / "results" / "cpu" / "trace-tiny-llama-tp2-sim.json", root / "traces")
    (root / "compiled").mkdir()
    shutil.copy(ROOT / "examples" / "schedules" / "norm_gemv_w2.amk", root / "compiled" / "schedule.amk")
    _, err = knobs.communicate(timeout=300)
    assert knobs.returncode == 0, err[-3000:]
    shots = Path(os.environ.get("AMK_UI_SCREENSHOTS") or tmp_path_factory.mktemp("shots"))
    shots.mkdir(parents=True, exist_ok=True)
    srv = Server(root)
    yield root, srv, shots
    srv.close()


@pytest.fixture(scope="module")
def held(ui):
    """An edit search started with --approve in the served directory (waiting for review)."""
    import time

    root = ui[0]
    proc = make_search(root / "edits", "--edits", "--approve")
    first = root / "edits" / "review" / "pending" / "trial-0001.json"
    t0 = time.monotonic()
    while not first.exists():  # trial 0 ran, trial 1 waits for the review
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < 120, "no proposal held for review after 120 s"
        time.sleep(0.1)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def browser(ui):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not fetch anything
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1280,900", "--no-first-run", "--disable-extensions"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()


def load(drv, srv, path: str) -> None:
    """Open ``path`` and wait until the page's script finished drawing (body[data-ready])."""
    from selenium.webdriver.support.ui import WebDriverWait

    drv.get(srv.url + path)
    WebDriverWait(drv, 30).until(lambda d: d.find_element("tag name", "body").get_attribute("data-ready"))
    errors = drv.find_elements("id", "error")
    assert not errors, errors[0].text


def shot(drv, shots: Path, name: str) -> None:
    drv.save_screenshot(str(shots / f"{name}.png"))


def test_runs_page(ui, browser):
    root, srv, shots = ui
    load(browser, srv, "/")
    rows = browser.find_elements("css selector", "#runs tr.run-row")
    paths = [r.find_element("css selector", "td a").text for r in rows]
    assert "knobs" in paths and "knobs/best/schedule.json" in paths
    shot(browser, shots, "runs")


def test_trials_table_and_latency_chart(ui, browser):
    root, srv, shots = ui
    load(browser, srv, "/static/run.html?path=knobs")
    rows = browser.find_elements("css selector", "#trials tbody tr.trial-row")
    n = len((root / "knobs" / "results.jsonl").read_text().splitlines())
    assert n == 3 and len(rows) == n
    assert rows[0].find_elements("css selector", "td")[1].text == "KEEP"
    assert {r.find_elements("css selector", "td")[5].text for r in rows} <= {"predicted", "-"}
    points = browser.find_elements("css selector", "#latency-chart circle.point")
    assert len(points) == sum(1 for r in rows if r.find_elements("css selector", "td")[4].text != "-")
    shot(browser, shots, "run")


def test_schedule_page_draws_the_trace(ui, browser):
    root, srv, shots = ui
    from ir.io import load_program

    prog = load_program(str(root / "knobs" / "best" / "schedule.json"))
    load(browser, srv, "/static/schedule.html?path=knobs/best/schedule.json")
    boxes = browser.find_elements("css selector", "#trace-view rect.task-slice")
    assert len(boxes) == len(prog.tasks)
    queues = browser.find_elements("css selector", "#queues tr.queue-row")
    assert len(queues) == len({(t.rank, t.worker) for t in prog.tasks})
    assert browser.find_elements("css selector", "#critical tr.crit-row")
    assert browser.find_element("id", "trace-link").get_attribute("href").endswith(
        "/api/trace?path=knobs%2Fbest%2Fschedule.json")
    shot(browser, shots, "schedule")
    browser.execute_script("document.getElementById('trace-wrap').scrollIntoView()")
    shot(browser, shots, "trace")


def test_trace_file_page(ui, browser):
    root, srv, shots = ui
    trace = json.loads((root / "traces" / "trace-tiny-llama-tp2-sim.json").read_text())
    load(browser, srv, "/static/trace.html?path=traces/trace-tiny-llama-tp2-sim.json")
    boxes = browser.find_elements("css selector", "#trace-view rect.task-slice")
    assert len(boxes) == sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "wait")
    labels = {t.text for t in browser.find_elements("css selector", "#trace-view text")}
    assert {"r0 worker 0", "r1 worker 3"} <= labels
    assert "simulated" in browser.find_element("id", "trace-meta").text
    shot(browser, shots, "trace-file")


def test_approving_in_the_browser_lets_the_search_finish(ui, held, browser):
    """Approve trial 1 and reject trial 2 in the review page: the search evaluates the one,
    records the other as rejected in review, and finishes; the validator's rejection of
    trial 1 (an unsafe move) shows its witness marked in the text IR."""
    from selenium.webdriver.support.ui import WebDriverWait

    root, srv, shots = ui
    load(browser, srv, "/static/review.html?path=edits")
    wait = WebDriverWait(browser, 90)
    btn = wait.until(lambda d: d.find_elements("id", "approve-trial-0001"))[0]
    assert held.poll() is None, "the search did not wait for the review"
    preview = browser.find_element("id", "preview-trial-0001").get_attribute("href")
    assert "edit.html?schedule=edits%2Fbase%2Fschedule.json&edits=" in preview
    shot(browser, shots, "review")
    btn.click()
    box = wait.until(lambda d: d.find_elements("id", "comment-trial-0002"))[0]
    box.send_keys("not this one")
    browser.find_element("id", "reject-trial-0002").click()
    _, err = held.communicate(timeout=120)
    assert held.returncode == 0, err[-3000:]
    recs = [json.loads(x) for x in (root / "edits" / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 3
    assert recs[1]["extra"].get("stage") != "review"  # approved: evaluated
    assert recs[2]["status"] == "REJECTED" and recs[2]["reason"] == "rejected in review: not this one"
    wait.until(lambda d: len(d.find_elements("css selector", "#decided tr.decided-row")) == 2)

    bad = next(r for r in recs if (r["extra"].get("verdict") or {}).get("errors"))
    load(browser, srv, "/static/run.html?path=edits")
    browser.find_element("css selector", f"tr[data-trial='{bad['trial']}'] a.witness-link").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element("tag name", "body").get_attribute("data-ready"))
    marked = {m.text for m in browser.find_elements("css selector", "#ir mark.task")}
    assert set(bad["extra"]["verdict"]["errors"][0]["tasks"]) <= marked
    assert "rejected" in browser.find_element("id", "verdict").text
    shot(browser, shots, "verdict")


def test_unsafe_edit_shows_the_validators_witness(ui, browser):
    """Dropping gemv.1's wait on the norm's counter races on hn: saving shows the
    validator's ReadWriteRace with both tasks marked, and writes nothing."""
    from selenium.webdriver.support.ui import WebDriverWait

    root, srv, shots = ui
    load(browser, srv, "/static/edit.html?schedule=compiled/schedule.amk")
    area = browser.find_element("id", "edits")
    area.clear()
    area.send_keys('[{"op": "drop_wait", "task": "gemv.1", "counter": "c.hn"}]')
    browser.find_element("id", "save").click()
    verdict = WebDriverWait(browser, 30).until(lambda d: d.find_elements("css selector", "#result #verdict"))[0]
    assert "rejected: ReadWriteRace" in verdict.text
    assert "norm writes and gemv.1 reads hn" in verdict.text
    assert browser.find_elements("id", "not-saved")
    marked = {m.text for m in browser.find_elements("css selector", "#ir mark.task")}
    assert {"norm", "gemv.1"} <= marked
    lines = [ln.text for ln in browser.find_elements("css selector", "#ir span.line.hl")]
    assert lines and all(ln.startswith("task ") for ln in lines)  # not "program \"norm-gemv-w2\""
    assert not (root / "compiled" / "edited").exists()
    shot(browser, shots, "edit")


def test_a_missing_browser_skips_unless_required(monkeypatch, tmp_path):
    """Without chromium the browser tests skip with the reason; AMK_REQUIRE_BROWSER=1 (CI)
    turns that into a failure."""
    import tests.test_ui_browser as mod

    monkeypatch.setattr(mod, "CHROMIUM", str(tmp_path / "no-chromium"))
    monkeypatch.delenv("AMK_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium chromium-driver"):
        mod._need_browser()
    monkeypatch.setenv("AMK_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="AMK_REQUIRE_BROWSER=1"):
        mod._need_browser()
