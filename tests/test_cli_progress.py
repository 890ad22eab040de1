"""The CLI's progress bar: shown on a terminal, quiet in pipes."""

from __future__ import annotations

import io
import sys

import pytest

from tdckpt.cli import _Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    out, err = _Tty(), _Tty()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    bar = _Progress("verify")
    bar(5, 10, "a.memmap")
    bar(10, 10, "b.memmap")
    drawn = err.getvalue()
    assert "verify [###############...............] 5/10 a.memmap" in drawn
    assert drawn.endswith("\n") and "10/10" in drawn
    assert out.getvalue() == ""


def test_progress_is_quiet_in_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Tty()
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # piped
    monkeypatch.setattr(sys, "stderr", err)
    _Progress("upgrade")(1, 2, "x")
    assert err.getvalue() == ""
