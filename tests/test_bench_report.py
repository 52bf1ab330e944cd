"""bench/report.py: docs/benchmarks.md is generated from the current result files and is current;
every result file under bench/results is cited by a docs page, and every cited one exists."""

from __future__ import annotations

import copy
import fnmatch
import glob
import json
import re
import subprocess
import sys
from pathlib import Path

from bench import report as report_mod

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"
# kept whole: the validator corpus and the CPU validator-speed records (docs/validator*.md)
KEPT_DIRS = ("corpus/", "cpu/")


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_page_is_current_and_short(tmp_path):
    out = tmp_path / "benchmarks.md"
    r = report("--out", str(out))
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert page == PAGE.read_text(), "docs/benchmarks.md is out of date: run python bench/report.py"
    assert len(page.splitlines()) < 300
    assert not re.search(r"\bsession\b", page, re.I)
    # every current result file has its table, and the two ratios that did not reproduce are
    # never shown without their remeasurement
    current = [p for p in sorted(RESULTS.glob("*/*.json"))
               if str(json.loads(p.read_text()).get("command", "")).startswith("amk bench")]
    assert len(current) >= 8
    for path in current:
        assert f"`bench/results/{path.relative_to(RESULTS).as_posix()}`" in page
    for claim, remeasured in (("1.14x", "0.97-0.99x"), ("1.35x", "1.06x")):
        for line in page.splitlines():
            if claim in line and "|" in line:
                assert f"not reproduced: {remeasured}" in line, line
    assert report("--check").returncode == 0


def _result(baselines, **kw):
    base = {"device": "NVIDIA H100 80GB HBM3", "model": "config:llama-3.2-1b", "tp": 1,
            "command": "amk bench config:llama-3.2-1b --config bench/configs/llama-3.2-1b.json --out /x/y.json",
            "latency_ms_median": 1.0, "roofline_ms": 0.8, "roofline_pct": 80.0, "correct": True,
            "timing": {"median_ms": 1.0, "p10_ms": 0.9, "p90_ms": 1.1}, "logit_check": {"ok": True},
            "date": "2026-01-02", "commit": "0123456789abcdef0123456789abcdef01234567",
            "baselines": baselines}
    base.update(kw)
    return base


def _bl(name, ms, correct=True):
    return {"name": name, "latency_ms_median": ms, "correct": correct,
            "timing": {"median_ms": ms, "p10_ms": ms, "p90_ms": ms}}


def test_fastest_run_per_mode_and_once_mark(tmp_path):
    res = tmp_path / "results"
    (res / "h100").mkdir(parents=True)
    data = _result([_bl("hf_compiled_graph", 2.0), _bl("hf_eager", 10.0), _bl("hf_compiled_graph #2", 1.5),
                    _bl("hf_compiled_graph[max-autotune-no-cudagraphs]", 1.9),
                    _bl("hf_compiled_graph[max-autotune-no-cudagraphs] #2", 2.5),
                    _bl("hf_compiled_graph[max-autotune-no-cudagraphs] #3", 1.7)])
    (res / "h100" / "llama-3.2-1b-tp1.json").write_text(json.dumps(data))
    (res / "h100" / "comm_r2.json").write_text(json.dumps({"bench": "comm"}))  # not a bench result
    out = tmp_path / "page.md"
    r = report("--results", str(res), "--out", str(out))
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    rows = [line for line in page.splitlines() if line.startswith("| torch.compile (default)")]
    # a mode's repeated runs ("<name> #<k>", amk bench --baseline-runs) make one row: the fastest
    assert rows == ["| torch.compile (default) + CUDA graph (fastest of 2 runs; the other 2.000) | "
                    "1.500 (1.500-1.500) | not recorded | yes | 1.50x |"]
    assert ("| torch.compile `max-autotune-no-cudagraphs` + CUDA graph (fastest of 3 runs; the others "
            "1.900, 2.500) | 1.700 (1.700-1.700) |") in page
    assert "#2" not in page and "#3" not in page
    assert "| 1.500 (torch.compile (default) + CUDA graph) | 1.50x |" in page  # the summary's cell
    assert "| HF eager (DynamicCache)¹ | 10.000" in page
    assert "recorded 2026-01-02 at commit 0123456" in page
    assert "--out bench/results/h100/llama-3.2-1b-tp1.json" not in page  # results dir is tmp
    assert "## Llama-3.2-1B shape, tp 1, 1 x H100" in page
    assert "comm_r2" not in page


def test_remeasured_ratio_is_shown_with_the_call_ratio(tmp_path):
    res = tmp_path / "results"
    (res / "h100").mkdir(parents=True)
    (res / "h100" / "llama-3.2-1b-tp1.json").write_text(json.dumps(_result([_bl("hf_compiled_graph", 1.14)])))
    (res / "notes.json").write_text(json.dumps({"h100/llama-3.2-1b-tp1.json": {
        "notes": ["Remeasured."], "remeasured": {"date": "2026-11-26", "baseline": "hf_compiled_graph",
                                                 "amk_ms": [1.0], "baseline_ms": [0.97, 0.99]}}}))
    out = tmp_path / "page.md"
    assert report("--results", str(res), "--out", str(out)).returncode == 0
    page = out.read_text()
    assert "1.14x in this call, not reproduced: 0.97-0.99x on 2026-11-26" in page
    assert "**Note.** Remeasured." in page


def test_bad_inputs_fail_in_one_line(tmp_path):
    res = tmp_path / "results"
    (res / "h100").mkdir(parents=True)
    bad = res / "h100" / "broken.json"
    bad.write_text("{")
    r = report("--results", str(res), "--out", str(tmp_path / "page.md"))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and str(bad) in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "page.md").exists()

    bad.unlink()
    (res / "h100" / "ok-tp1.json").write_text(json.dumps(_result([])))
    (res / "notes.json").write_text(json.dumps({"h100/gone.json": {"notes": ["x"]}}))
    r = report("--results", str(res), "--out", str(tmp_path / "page.md"))
    assert r.returncode == 2 and "notes.json" in r.stderr and "h100/gone.json" in r.stderr

    (res / "notes.json").write_text(json.dumps({"h100/ok-tp1.json": {"remeasured": {"date": "x"}}}))
    r = report("--results", str(res), "--out", str(tmp_path / "page.md"))
    assert r.returncode == 2 and "remeasured" in r.stderr


def test_check_reports_a_stale_page(tmp_path):
    stale = tmp_path / "benchmarks.md"
    text = PAGE.read_text()
    m = re.search(r"\| (\d+\.\d{3}) \|", text)  # the first ms/token cell of the summary
    stale.write_text(text[:m.start(1)] + "1234.567" + text[m.end(1):])
    r = report("--check", "--out", str(stale))
    assert r.returncode == 1 and "out of date" in r.stderr
    assert stale.read_text() != PAGE.read_text()  # --check writes nothing


def _expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd`` (nested braces are not used in the docs)."""
    pats, out = [pattern], []
    while pats:
        p = pats.pop()
        if "{" not in p:
            out.append(p)
            continue
        head, rest = p.split("{", 1)
        alts, tail = rest.split("}", 1)
        pats += [head + a + tail for a in alts.split(",")]
    return out


def covered_files() -> tuple[set[Path], list[str]]:
    """Result files the docs cite, and the citations that match nothing.

    A citation is a ``bench/results/...`` path or glob in README.md or docs/*.md. A file path or
    glob covers the files it matches; a directory (``.../``) covers only those of its files
    whose name (or path below it) matches a file name or glob quoted in the same page, e.g.
    "files in `bench/results/h200/X/`: `sync_*.json`"."""
    covered, dangling = set(), []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        names = {n for m in re.finditer(r"`([^`\s]+)`", text)
                 for n in _expand(m.group(1)) if re.search(r"(\.(json|txt|csv|gz|tsv|jsonl|png|md)|_\*)$", n)}
        for m in re.finditer(r"bench/results/[A-Za-z0-9_.*{},/\-]*[A-Za-z0-9_*}/]", text):
            for pat in _expand(m.group(0)):
                if pat == "bench/results/":  # the folder itself, as in "bench/results/<gpu>/"
                    continue
                hits = [Path(h) for h in glob.glob(str(ROOT / pat), recursive=True)]
                if not hits:
                    dangling.append(f"{doc.name}: {pat}")
                for h in hits:
                    if h.is_file():
                        covered.add(h)
                        continue
                    for f in h.rglob("*"):
                        rel = f.relative_to(h).as_posix()
                        if f.is_file() and any(fnmatch.fnmatch(rel, n) or fnmatch.fnmatch(f.name, n)
                                               for n in names):
                            covered.add(f)
    return covered, dangling


def test_result_files_are_cited_and_citations_exist():
    covered, dangling = covered_files()
    assert not dangling, f"docs cite result files that do not exist: {dangling}"
    uncited = [p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file()
               and p not in covered and p.name != "notes.json"
               and not p.relative_to(RESULTS).as_posix().startswith(KEPT_DIRS)]
    assert not uncited, f"result files no docs page cites (delete them or cite them): {uncited}"


def test_no_result_or_doc_mentions_work_sessions():
    pattern = re.compile(r"\bsession\b", re.I)
    paths = [*RESULTS.rglob("*"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md",
             *(ROOT / "scripts").glob("*"), *(ROOT / "bench" / "suites").glob("*")]
    hits = [str(p.relative_to(ROOT)) for p in paths
            if p.is_file() and p.suffix in (".json", ".txt", ".md", ".tsv", ".jsonl", ".csv", ".sh", ".py")
            and pattern.search(p.read_text(errors="replace"))]
    assert not hits


def test_report_module_renders_without_git(tmp_path, monkeypatch):
    """A result without date/commit fields outside a git checkout says so instead of failing."""
    res = tmp_path / "results"
    (res / "h200").mkdir(parents=True)
    data = copy.deepcopy(_result([]))
    del data["date"], data["commit"]
    (res / "h200" / "m-tp1.json").write_text(json.dumps(data))
    monkeypatch.setattr(report_mod, "ROOT", tmp_path)
    page = report_mod.render(res)
    assert "date and commit not recorded" in page


def test_dist_and_quant_reports_get_their_own_tables(tmp_path):
    """A bench/dist.py report: each method's fastest repeat, amk against the eager original and
    against the fastest NCCL run; a partial bench/quant.py report says it was cut off."""
    res = tmp_path / "results"
    (res / "h100x2").mkdir(parents=True)

    def row(method, reps, ok=True, speedup=None):
        return {"pattern": "allgather_matmul", "M": 256, "N": 256, "K": 256, "method": method,
                "status": "ran", "repeats_ms": reps, "ok": ok, "speedup": speedup}

    dist = {"device": "NVIDIA H100 80GB HBM3", "world": 2, "command": "torchrun bench/dist.py --out /x/y.json",
            "settings": {"repeats": 2},
            "rows": [row("nccl", [0.12, 0.10]), row("nccl_graph", [0.03, 0.02]),
                     row("amk", [0.025, 0.04], speedup=0.5)]}
    (res / "h100x2" / "dist-2gpu.json").write_text(json.dumps(dist))
    quant = {"device": "NVIDIA H100 80GB HBM3", "model": "config:llama-3.2-1b", "partial": True,
             "rows": [{"method": "amk int8", "weights": "int8", "latency_ms_median": 1.25, "roofline_pct": 40.0,
                       "correct": True}],
             "distance": {"int8": {"greedy_match": 0.75, "tokens": 64, "ppl_ratio": 1.01}}}
    (res / "h100x2" / "quant-x.json").write_text(json.dumps(quant))
    page = report_mod.render(res)
    assert "| allgather_matmul | 256 | 0.100 | 0.020 | 0.025 | 2.50x | 0.50x |" in page
    assert "--out bench/results/h100x2/dist-2gpu.json" in page
    assert "cut off by the device call's time limit" in page
    assert "| 1 x H100, Llama-3.2-1B shape | amk int8 | int8 | 1.250 | 40.0% | yes |" in page
    assert "greedy agreement 0.750 over 64 tokens, perplexity ratio 1.0100" in page
