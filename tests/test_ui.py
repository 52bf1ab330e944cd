"""``amk ui``: the JSON API and the static files of the local web app (amk/webui.py), served
by uvicorn on a loopback port: runs, trials, schedules, traces, verdicts, review, the edit
editor; path traversal refused; nothing of the environment in any response."""

from __future__ import annotations

import json
import re
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECRET = "sk-ant-test-secret-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``amk.webui.create_app(root)`` under uvicorn in a thread, on a free loopback port."""

    def __init__(self, root: Path, db: str | None = None, hosts: list[str] | None = None):
        import uvicorn

        from amk.webui import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(create_app(root, db, hosts), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return
            time.sleep(0.02)
        raise RuntimeError("the server did not start")

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def make_search(out: Path, *extra: str) -> subprocess.Popen:
    """A short sim search of the tiny model (3 trials) into ``out``, started in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "amk", "search", "config:tiny-llama", "--backend", "sim",
                             "--trials", "3", "--out", str(out), "--quiet", *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A directory with a knob search and an edit search (3 sim trials each), and a compiled
    schedule, served; the environment holds a fake API key."""
    root = tmp_path_factory.mktemp("ui")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [make_search(root / "knobs"), make_search(root / "edits", "--edits"),
             subprocess.Popen([sys.executable, "-m", "amk", "tune", "config:tiny-llama", "--backend", "sim",
                               "--trials", "2", "--out", str(root / "tune"), "--db", str(root / "db")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    (root / "compiled").mkdir()
    shutil.copy(ROOT / "examples" / "schedules" / "norm_gemv_w2.amk", root / "compiled" / "schedule.amk")
    shutil.copy(ROOT / "bench" / "results" / "cpu" / "trace-tiny-llama-tp2-sim.json", root / "compiled")
    old = os.environ.get("ANTHROPIC_API_KEY")
    os.environ["ANTHROPIC_API_KEY"] = SECRET
    srv = Server(root)
    yield root, srv
    srv.close()
    if old is None:
        os.environ.pop("ANTHROPIC_API_KEY", None)
    else:
        os.environ["ANTHROPIC_API_KEY"] = old


def test_runs_trials_schedule_trace_verdict(served):
    from lowering.trace import check_trace

    root, srv = served
    code, body = srv.get("/api/runs")
    runs = {r["path"]: r for r in json.loads(body)["runs"]}
    assert code == 200 and runs["knobs"]["kind"] == "search" and runs["edits"]["kind"] == "search"
    assert runs["compiled/schedule.amk"]["kind"] == "schedule"
    assert runs["compiled/trace-tiny-llama-tp2-sim.json"]["kind"] == "trace"
    code, body = srv.get("/api/trace?path=compiled/trace-tiny-llama-tp2-sim.json")
    assert code == 200 and body == (root / "compiled" / "trace-tiny-llama-tp2-sim.json").read_bytes()
    code, body = srv.get("/api/run?path=edits")
    run = json.loads(body)
    assert code == 200 and len(run["trials"]) == 3
    assert [t["trial"] for t in run["trials"]] == [0, 1, 2]
    rejected = [t for t in run["trials"] if t["status"] == "REJECTED"]
    assert rejected and rejected[0]["has_witness"]
    code, body = srv.get(f"/api/verdict?path=edits&trial={rejected[0]['trial']}")
    v = json.loads(body)
    assert code == 200 and v["verdict"]["ok"] is False
    assert re.search(r"\ntask lm\.combine\.r0 @r0\.w\d+ ", v["text"])  # the edited program's text IR
    assert set(v["highlight"]["tasks"]) >= set(v["verdict"]["errors"][0]["tasks"])
    code, body = srv.get("/api/run?path=tune")
    tune = json.loads(body)
    n = len((root / "tune" / "trials.jsonl").read_text().splitlines())
    assert code == 200 and tune["kind"] == "tune" and len(tune["trials"]) == n >= 2
    assert tune["trials"][0]["status"] == "KEEP" and tune["trials"][0]["timing_source"] == "predicted"
    entries = [e for e in tune["tunedb"] if e.get("source") == "user"]
    assert len(entries) == 1 and entries[0]["tp"] == 1 and entries[0]["ms"] > 0
    code, body = srv.get("/api/schedule?path=compiled/schedule.amk")
    s = json.loads(body)
    assert code == 200 and s["queues"] and s["summary"]["critical_path"] and "task " in s["text"]
    code, body = srv.get("/api/trace?path=compiled/schedule.amk")
    assert code == 200 and check_trace(json.loads(body)) == []
    code, body = srv.get("/static/app.js")
    assert code == 200 and b"traceView" in body


def test_edit_editor_validates_and_saves_only_accepted(served):
    root, srv = served
    # the combine shares the argmax's worker and waits for nothing: on another worker it races
    base = json.loads((root / "edits" / "base" / "schedule.json").read_text())
    w = next(t["worker"] for t in base["tasks"] if t["id"] == "lm.argmax.k0.r0")
    bad = [{"op": "move", "task": "lm.combine.r0", "worker": (w + 1) % base["workers"]}]
    code, out = srv.post("/api/edit/validate", {"schedule": "edits/base/schedule.json", "edits": bad, "save": "x"})
    assert code == 200 and out["ok"] is False and out["saved"] is None
    assert "ReadWriteRace" in out["verdict"]["classes"] and "lm.combine.r0" in out["highlight"]["tasks"]
    assert not (root / "edits" / "base" / "edited").exists()
    code, out = srv.post("/api/edit/validate", {"schedule": "edits/base/schedule.json", "edits": [], "save": "same"})
    assert code == 200 and out["ok"] is True and out["saved"] == "edits/base/edited/same.amk"
    assert (root / "edits" / "base" / "edited" / "same.amk").is_file()
    text = (root / "compiled" / "schedule.amk").read_text()
    code, out = srv.post("/api/edit/validate", {"schedule": "compiled/schedule.amk", "save": "t",
                                                "text": text.replace("wait(c.hn >= 1) ", "")})
    assert code == 200 and out["ok"] is False and "gemv.1" in out["highlight"]["tasks"]
    assert not (root / "compiled" / "edited").exists()
    code, out = srv.post("/api/edit/validate", {"schedule": "compiled/schedule.amk", "save": "t", "text": text})
    assert code == 200 and out["ok"] is True and out["saved"] == "compiled/edited/t.amk"
    code, out = srv.post("/api/edit/validate", {"text": "amk 1\nprogram"})
    assert code == 400 and "error" in out
    code, out = srv.post("/api/edit/validate", {"schedule": "edits/base/schedule.json",
                                                "edits": [{"op": "move", "task": "nope", "worker": 0}]})
    assert code == 400 and "nope" in out["error"]
    code, out = srv.post("/api/edit/validate", {"schedule": "edits/base/schedule.json", "edits": "[", "save": "x"})
    assert code == 400 and "invalid JSON" in out["error"]
    code, out = srv.post("/api/edit/validate", {"schedule": "edits/base/schedule.json", "edits": [], "save": "../x"})
    assert code == 400 and "save" in out["error"]


@pytest.mark.parametrize("path", ["..", "../..", "/etc/passwd", "%2Fetc%2Fpasswd", "..%2F..%2Fetc%2Fpasswd",
                                  "knobs/../../x", "link-out/passwd", ".hidden/schedule.amk"])
def test_paths_outside_the_directory_are_refused(served, path):
    root, srv = served
    link = root / "link-out"
    if not link.exists():
        link.symlink_to("/etc")
    (root / ".hidden").mkdir(exist_ok=True)
    for api in ("/api/run?path=", "/api/schedule?path=", "/api/trace?path=", "/api/review?path="):
        code, body = srv.get(api + path)
        assert code == 403, (api, path, code, body[:200])
    code, out = srv.post("/api/edit/validate", {"schedule": path.replace("%2F", "/"), "edits": []})
    assert code == 403
    code, body = srv.get("/static/..%2Fwebui.py")
    assert code == 404


def test_host_header_and_no_environment_in_responses(served):
    root, srv = served
    code, _ = srv.get("/api/runs", headers={"Host": "attacker.example:80"})
    assert code == 400
    pages = ["/", "/static/index.html", "/static/app.js", "/static/style.css", "/api/runs", "/api/run?path=knobs",
             "/api/run?path=edits", "/api/verdict?path=edits&trial=1", "/api/review?path=edits",
             "/api/schedule?path=knobs/best/schedule.json", "/api/trace?path=knobs/best/schedule.json"]
    for page in pages:
        code, body = srv.get(page)
        assert code in (200, 307), page
        assert SECRET.encode() not in body, page
        assert b"ANTHROPIC_API_KEY" not in body, page
    code, body = srv.get("/api/run?path=compiled")
    assert code == 404


def test_amk_ui_command(tmp_path):
    """The console command: binds the loopback address, prints its URL, serves the API; an
    explicit --host warns; a missing DIR is one error line, exit 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "amk", "ui", str(tmp_path / "nope")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'nope'}: not a directory"
    for host, warn in ((None, False), ("127.0.0.2", True)):
        cmd = [sys.executable, "-m", "amk", "ui", str(tmp_path), "--port", "0"] + (["--host", host] if host else [])
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            while True:
                line = p.stderr.readline()
                assert line, "".join(lines)
                lines.append(line)
                if "serving" in line:
                    break
            url = line.split(" at ")[1].split()[0]
            assert url.startswith(f"http://{host or '127.0.0.1'}:")
            assert any(ln.startswith("warning:") for ln in lines) == warn
            with urllib.request.urlopen(url + "api/runs", timeout=30) as resp:
                assert json.loads(resp.read())["runs"] == []
        finally:
            p.terminate()
            p.wait(timeout=30)


def test_witness_names_of_a_deadlock_and_a_race():
    """The names the verdict page marks: a deadlock cycle's task and counter nodes, a race's
    pair of tasks."""
    from amk.editing import verdict_report
    from amk.webui import _witness_names
    from ir.text import parse_program
    from validator import validate

    text = (ROOT / "examples" / "schedules" / "norm_gemv_w2.amk").read_text()
    # gemv.1 waits on a counter nobody signals: the queues stall there
    bad = parse_program(text.replace("counter c.u @r0 width=32", "counter c.u @r0 width=32\ncounter c.never @r0 width=32")
                        .replace("wait(c.hn >= 1)", "wait(c.never >= 1)"))
    names = _witness_names(verdict_report(validate(bad)))
    assert "gemv.1" in names["tasks"] and "c.never" in names["counters"], names
    race = {"errors": [{"tasks": ["a", "b"], "witness": {"read": {"task": "b"}, "write": {"task": "a"}}},
                       {"tasks": ["x"], "witness": {"cycle": [{"from": "task x", "to": "counter c.1"}]}}]}
    assert _witness_names(race) == {"tasks": ["a", "b", "x"], "counters": ["c.1"]}


def test_amk_ui_is_not_imported_by_other_commands(tmp_path):
    code = """
import contextlib, io, sys
from amk.cli import build_parser, main
build_parser()
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(["profile", sys.argv[1], "--seq-len", "1", "--json"])
print(rc, sorted(m for m in ("fastapi", "uvicorn", "starlette") if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "examples" / "schedules" / "norm_gemv_w2.amk")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "0 []"


def test_a_wildcard_bind_accepts_any_host_name(tmp_path):
    """``--host 0.0.0.0`` (warned about) is reached by other names: the Host check is off;
    a named --host adds that name to the loopback ones."""
    for hosts, code in ((["*"], 200), (["10.1.2.3"], 400)):
        srv = Server(tmp_path, hosts=hosts)
        try:
            assert srv.get("/api/runs", headers={"Host": "box.lan:8765"})[0] == code
            assert srv.get("/api/runs", headers={"Host": "10.1.2.3:8765"})[0] == 200
        finally:
            srv.close()
