"""Tracebacks show the user's frames: an error raised inside popdist_lite (a collective's
agreed error) is printed and recorded by the failure hook without the library's frames,
ending at the user's call, while the exception keeps every frame and
``POPDIST_LITE_FULL_TRACEBACK=1`` prints them."""

import os
import re
import sys
import textwrap
import threading
import traceback

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite import _excepthook
from helpers import clean_env, run_mpi, timeout_for

LIBRARY = os.path.dirname(os.path.realpath(pl.__file__)) + os.sep
MESSAGE = ("ValueError: all_gather: argument x: replica 1 passed shape (3, 3), expected the same shape as "
           "replica 0, which passed (2, 3)")


def library_frames(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if line.lstrip().startswith("File ") and LIBRARY in os.path.realpath(line.split('"')[1]) + os.sep]


@timeout_for(1)
def test_collective_error_under_mpirun_names_the_users_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import popdist_lite as pl

        pl.init()
        x = np.zeros((2 + pl.replica_id(), 3), np.float32)
        y = pl.all_gather(x)
    """))
    r = run_mpi(2, [sys.executable, str(script)], env=clean_env())
    assert r.returncode != 0
    err = r.stderr
    # each replica prints the message once, unchanged, after the user's line and no library frame
    assert err.count(MESSAGE + "\n") == 2, err
    blocks = re.findall(r"Traceback \(most recent call last\):\n(.*?)\nValueError", err, re.S)
    assert len(blocks) == 2, err
    for block in blocks:
        assert block.splitlines()[0] == f'  File "{script}", line 7, in <module>', err
        assert "y = pl.all_gather(x)" in block
        assert not library_frames(block), block
    assert err.count("frames of popdist_lite not shown; POPDIST_LITE_FULL_TRACEBACK=1 shows them") == 2


def _raise_mismatch():
    pl.init()
    pl.all_gather(np.ones(3, np.float32), out=np.empty((2, 3), np.float32))  # this replica's own error


def test_the_exception_keeps_every_frame_and_the_full_traceback_is_one_variable_away(monkeypatch):
    with pytest.raises(ValueError) as info:
        _raise_mismatch()
    exc = info.value
    # a debugger (pdb.post_mortem) still walks into the library
    assert any(f.filename.endswith(os.path.join("collectives", "agreement.py"))
               for f in traceback.extract_tb(exc.__traceback__))
    monkeypatch.delenv(_excepthook.FULL_TRACEBACK_ENV, raising=False)
    short = _excepthook.format_exception(type(exc), exc, exc.__traceback__)
    assert not library_frames(short) and "in _raise_mismatch" in short
    assert "pl.all_gather(np.ones(3, np.float32), out=" in short
    assert short.splitlines()[-2] == f"ValueError: {exc}"  # the message as it was raised
    monkeypatch.setenv(_excepthook.FULL_TRACEBACK_ENV, "1")
    full = _excepthook.format_exception(type(exc), exc, exc.__traceback__)
    assert full == "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert any("agreement.py" in line for line in library_frames(full))


def test_chained_exceptions_lose_the_library_frames_too():
    try:
        try:
            _raise_mismatch()
        except ValueError as inner:
            raise RuntimeError("step 3 failed") from inner
    except RuntimeError as exc:
        text = _excepthook.format_exception(type(exc), exc, exc.__traceback__, full=False)
    assert "The above exception was the direct cause" in text and "RuntimeError: step 3 failed" in text
    assert "ValueError: all_gather: replica 0: argument out" in text and not library_frames(text)


def test_an_error_with_no_user_frame_keeps_the_library_frames():
    """A thread that runs library code only (no frame of the user's): nothing to hide behind."""
    pl.init()
    caught = []
    thread = threading.Thread(target=pl.all_gather, args=(np.ones(3, np.float32),),
                              kwargs={"out": np.empty((2, 3), np.float32)})
    previous, threading.excepthook = threading.excepthook, caught.append
    try:
        thread.start()
        thread.join()
    finally:
        threading.excepthook = previous
    [args] = caught
    text = _excepthook.format_exception(args.exc_type, args.exc_value, args.exc_traceback, full=False)
    assert any("agreement.py" in line for line in library_frames(text))
    assert "not shown" not in text
