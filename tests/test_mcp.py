"""`amk mcp`: the MCP server driven by the SDK's own client over stdio: list the tools, call
every one, structured errors for malformed IR, an unknown model and a path escaping the
work directory."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

mcp = pytest.importorskip("mcp")

ROOT = Path(__file__).resolve().parents[1]
TOOLS = {"lower", "validate", "edit", "summary", "slice", "run_sim", "bench", "search_results"}


def _data(result) -> dict:
    """A tool result's JSON object (structured content, else the text block)."""
    sc = getattr(result, "structured_content", None)
    if sc is None:
        sc = getattr(result, "structuredContent", None)
    if isinstance(sc, dict):
        return sc.get("result", sc) if set(sc) == {"result"} else sc
    return json.loads(result.content[0].text)


def _with_client(workdir: Path, calls):
    """Start ``amk mcp --workdir`` as a subprocess and run ``calls(session)`` in a client."""
    import anyio
    from mcp import ClientSession, StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable, args=["-m", "amk", "mcp", "--workdir", str(workdir)],
        env={"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", ""),
             "ANTHROPIC_API_KEY": "sk-secret-test-key"},
        cwd=str(ROOT))
    out: dict = {}

    async def main():
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                await calls(session, out)

    anyio.run(main)
    return out


def test_mcp_server_tools(tmp_path):
    wd = tmp_path / "wd"
    (wd / "search" / "best").mkdir(parents=True)
    (wd / "search" / "results.jsonl").write_text('{"trial": 0}\n')
    (wd / "search" / "best" / "config.json").write_text('{"lowering": {"tile": 32}}')
    (tmp_path / "outside.amk").write_text("amk 1\n")

    async def calls(s, out):
        out["tools"] = {t.name for t in (await s.list_tools()).tools}
        call = lambda tool, **a: s.call_tool(tool, a)  # noqa: E731
        out["lower"] = _data(await call("lower", model="config:tiny-llama", tp=1, name="tiny",
                                        config={"max_seq": 16, "workers": 2}))
        out["unknown_model"] = _data(await call("lower", model="config:no-such-model"))
        out["summary"] = _data(await call("summary", schedule="tiny.amk"))
        out["slice"] = _data(await call("slice", schedule="tiny.amk", layer=0, worker=1))
        out["validate_bad"] = _data(await call("validate", ir="amk 1\nprogram \"x\"\nranks 2 workers [\n"))
        text = (wd / "tiny.amk").read_text() if (wd / "tiny.amk").exists() else ""
        out["validate_ok"] = _data(await call("validate", ir=text))
        out["edit_bad"] = _data(await call("edit", schedule="tiny.amk",
                                           edits=[{"op": "drop_wait", "task": "l0.q.t0.r0",
                                                   "counter": "c.l0.ln1.r0"}], out="bad.amk"))
        out["edit_schema"] = _data(await call("edit", schedule="tiny.amk",
                                              edits=[{"op": "split", "task": 3}]))
        out["edit_ok"] = _data(await call("edit", schedule="tiny.amk", out="split.amk",
                                          edits=[{"op": "split", "task": "l0.q.t0.r0"}]))
        out["run_sim"] = _data(await call("run_sim", schedule="split.amk", steps=2))
        out["bench"] = _data(await call("bench", model="config:tiny-llama"))
        out["search_list"] = _data(await call("search_results", search_dir="search"))
        out["search_read"] = _data(await call("search_results", search_dir="search", file="best/config.json"))
        out["escape_edit"] = _data(await call("edit", schedule="../outside.amk", edits=[]))
        out["escape_search"] = _data(await call("search_results", search_dir="search", file="../../outside.amk"))
        out["escape_abs"] = _data(await call("summary", schedule=str(tmp_path / "outside.amk")))
        out["escape_lower"] = _data(await call("lower", model="config:tiny-llama", name="../x"))

    out = _with_client(wd, calls)
    assert out["tools"] == TOOLS
    low = out["lower"]
    assert low["ok"] is True and low["schedule"] == "tiny.amk" and low["verdict"]["ok"]
    assert (wd / "tiny.amk").is_file() and (wd / "tiny.amk.meta.json").is_file()
    assert out["unknown_model"]["ok"] is False and "no-such-model" in out["unknown_model"]["error"]
    assert out["summary"]["ok"] and out["summary"]["critical_path"] and out["summary"]["workers"]
    assert "task l0." in out["slice"]["ir"] and "@r0.w1" in out["slice"]["ir"]
    assert out["validate_bad"]["ok"] is False and "ir:3:" in out["validate_bad"]["error"]
    assert out["validate_ok"]["ok"] is True
    bad = out["edit_bad"]
    assert bad["ok"] is False and "ReadWriteRace" in bad["classes"] and bad["written"] is None
    assert not (wd / "bad.amk").exists()
    assert out["edit_schema"]["ok"] is False and "edit 0 (split): field 'task'" in out["edit_schema"]["error"]
    assert out["edit_ok"]["ok"] is True and out["edit_ok"]["written"] == "split.amk"
    sim = out["run_sim"]
    assert sim["ok"] is True, sim
    assert len(sim["checks"]) == 2 and all(c["argmax_agree"] for c in sim["checks"])
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        assert out["bench"] == {"ok": False, "error": "no GPU on this machine: bench and profile need one",
                                "error_type": "no_gpu"}
    files = {f["path"] for f in out["search_list"]["files"]}
    assert files == {"results.jsonl", os.path.join("best", "config.json")}
    assert json.loads(out["search_read"]["text"]) == {"lowering": {"tile": 32}}
    for key in ("escape_edit", "escape_search", "escape_abs", "escape_lower"):
        r = out[key]
        assert r["ok"] is False and r["error_type"] == "bad_input", (key, r)
        assert "escapes the work directory" in r["error"] or "is absolute" in r["error"] \
            or "plain file name" in r["error"], (key, r)
    assert "sk-secret-test-key" not in json.dumps(out, default=sorted)


def test_mcp_import_is_lazy():
    import subprocess

    code = ("import sys, amk.cli as c; c.build_parser(); "
            "import amk.commands.edit; print('mcp' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr
