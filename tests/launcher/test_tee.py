"""popdist_lite_launcher.node.tee.Tee: a copy of a pipe with its last lines kept, and the end
of a line a writer left unfinished."""

import os

import pytest

from popdist_lite_launcher.node.tee import Tee


def _copy(chunks: list[bytes], max_lines: int, **kwargs) -> tuple[Tee, bytes]:
    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    tee = Tee(src_r, dst_w, max_lines, **kwargs)
    for chunk in chunks:
        os.write(src_w, chunk)
    os.close(src_w)
    tee.end_line(timeout=30)
    os.close(dst_w)
    with os.fdopen(dst_r, "rb") as f:
        return tee, f.read()


@pytest.mark.parametrize("chunks, copied", [
    ([b"one\ntwo\n"], b"one\ntwo\n"),
    ([b"one\nhal", b"f"], b"one\nhalf\n"),
    ([], b""),
    ([b"ends with a NUL\n\0"], b"ends with a NUL\n"),
])
def test_a_line_left_unfinished_is_ended(chunks, copied):
    tee, out = _copy(chunks, 3, drop=b"\0")
    assert out == copied
    assert tee.text() == copied.decode().rstrip("\n")


def test_the_tail_keeps_the_last_lines_and_no_tail_is_a_plain_copy():
    lines = [f"line {i}\n".encode() for i in range(10)]
    tee, out = _copy(lines, 3)
    assert out == b"".join(lines)
    assert tee.text() == "line 7\nline 8\nline 9"
    tee, out = _copy(lines, 0)
    assert out == b"".join(lines) and tee.text() == ""
