"""scripts/device_wheels.sh: the folders it fills are the ones scripts/device_env.sh installs
(``.whl*/``, git-ignored), and a folder it does not know is one line and exit code 2, before
any download."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_wheels.sh"


def test_unknown_folder_is_one_line_and_exit_2():
    r = subprocess.run(["bash", str(SCRIPT), ".whl", ".whl-bogus"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and ".whl-bogus" in r.stderr and r.stdout == ""


def test_folders_are_carried_and_ignored():
    text = SCRIPT.read_text()
    folders = re.findall(r"^\s+\[(\.whl[^\]]*)\]=", text, re.M)
    assert set(folders) == {".whl", ".whl-nv", ".whl-quant", ".whl-opt"}
    assert ".whl*/" in (ROOT / ".gitignore").read_text().splitlines()
    assert ".whl*/*.whl" in (ROOT / "scripts" / "device_env.sh").read_text()
    # every package is pinned, so a carried folder is the same on every machine
    for pkgs in re.findall(r'^\s+\[\.whl[^\]]*\]="([^"]+)"', text, re.M):
        assert all("==" in p for p in pkgs.split()), pkgs
