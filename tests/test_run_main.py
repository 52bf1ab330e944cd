"""ground.errors.run_main: a script's exit code, or one line for an AmkError."""

from __future__ import annotations

import pytest

from ground.errors import AmkError, run_main


def test_exit_code_is_mains_return_value():
    with pytest.raises(SystemExit) as e:
        run_main(lambda: 3, "bench/x.py")
    assert e.value.code == 3
    with pytest.raises(SystemExit) as e:
        run_main(lambda: None, "bench/x.py")
    assert e.value.code is None


def test_amk_error_is_one_line_with_its_exit_code(capsys):
    def main():
        raise AmkError("cannot write out.json: read-only file system", exit_code=2)

    with pytest.raises(SystemExit) as e:
        run_main(main, "bench/x.py")
    assert e.value.code == 2
    assert capsys.readouterr().err == "bench/x.py: error: cannot write out.json: read-only file system\n"


def test_other_exceptions_propagate():
    def main():
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run_main(main, "bench/x.py")
