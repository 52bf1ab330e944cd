"""Result files written whole or not at all.

Every file amk produces (schedules, reports, search records, benchmark JSON) is written to a
temporary name in the destination directory, flushed and fsynced, then renamed over the
destination (``os.replace`` is atomic on POSIX). A reader or a crash therefore sees either the
old file or the complete new one, never a truncated one. A failed write (unwritable
directory, full disk) removes the temporary file and raises ``AmkError`` with one line that
names the path, exit code 2.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from ground.errors import AmkError


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path.

    Creates missing parent directories. Keeps an existing file's permission bits (0644 for a
    new file). ``durable`` also fsyncs the file and its directory, so the rename survives a
    power loss (search checkpoints need it; a schedule file can skip it).

    Raises:
        AmkError: the directory cannot be created or written, or the disk is full.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # mkstemp makes 0600
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        if durable:
            _fsync_dir(directory)
    except OSError as e:
        raise AmkError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, durable: bool = True) -> Path:
    """``atomic_write_bytes`` of ``text`` in UTF-8 with ``\\n`` line ends."""
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, durable: bool = True) -> Path:
    """Write ``obj`` as indented, key-sorted JSON, atomically.

    Non-finite floats (NaN, inf) become ``null`` so the file stays strict JSON.
    """
    return atomic_write_text(path, json.dumps(finite(obj), indent=2, sort_keys=True) + "\n",
                             durable=durable)


def parse_json(text: str, path: str | os.PathLike, what: str = "") -> Any:
    """``json.loads(text)`` of the file ``path``; AmkError ``PATH:LINE:COL: invalid JSON[ in
    WHAT]: MSG`` (exit 2) when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise AmkError(f"{path}:{e.lineno}:{e.colno}: invalid JSON{' in ' + what if what else ''}: "
                       f"{e.msg}") from None


def read_json(path: str | os.PathLike, what: str = "") -> Any:
    """The JSON value of the file ``path`` (UTF-8); AmkError (exit 2) ``PATH: cannot read[
    WHAT]: REASON`` when it cannot be read, or ``parse_json``'s line:column message."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise AmkError(f"{path}: cannot read{' ' + what if what else ''}: "
                       f"{getattr(e, 'strerror', None) or e}") from None
    return parse_json(text, path, what)


def finite(obj: Any) -> Any:
    """A copy of a JSON-able value with NaN and infinities replaced by ``None``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
