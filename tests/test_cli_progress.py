"""Progress bars (tqdm): drawn on a terminal, quiet in pipes, closed on Ctrl-C."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import copy_case
from tensordict import TensorDict

import tdckpt
from tdckpt import CheckpointManager
from tdckpt._cli.output import _progress
from tdckpt._progress import Bar
from tdckpt.cli import EXIT_INTERRUPTED, EXIT_OK, main
from tdckpt.schema import MANIFEST_NAME


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch: pytest.MonkeyPatch) -> tuple[_Tty, _Tty]:
    """stdout and stderr as terminals (set in the test body: pytest's capture resets
    sys.stdout/stderr after a fixture's setup)."""
    out, err = _Tty(), _Tty()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    return out, err


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, TensorDict(a=torch.arange(1000.0), b={"c": torch.ones(3, 4)}))
    return root


def test_the_bar_draws_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    out, err = _terminal(monkeypatch)
    with _progress("upgrade", unit="op") as bar:
        bar(5, 10, "write a.memmap")
        assert "upgrade:" in err.getvalue()  # drawn from the first call on
        bar(10, 10, "rename b")
    drawn = err.getvalue()
    assert "upgrade: 100%" in drawn and "10/10" in drawn and "rename b" in drawn
    assert drawn.endswith("\n")  # closed: the next line starts clean
    assert out.getvalue() == ""


def test_the_bar_escapes_what_a_terminal_must_not_interpret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, err = _terminal(monkeypatch)
    with _progress("upgrade", unit="op") as bar:
        bar(1, 2, "write \x1b[2Jevil")
    assert "\x1b[2J" not in err.getvalue() and "\\x1b[2Jevil" in err.getvalue()


def test_the_bar_is_quiet_in_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Tty()
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # piped
    monkeypatch.setattr(sys, "stderr", err)
    with _progress("upgrade", unit="op") as bar:
        bar(1, 2, "x")
    assert err.getvalue() == ""


def test_verify_draws_a_bar_of_bytes_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, err = _terminal(monkeypatch)
    root = _root(tmp_path)
    assert main(["verify", str(root)]) == EXIT_OK
    assert "verify: 100%" in err.getvalue() and "B/s" in err.getvalue()
    assert ": OK (4 files" in out.getvalue() and "verify:" not in out.getvalue()


def test_json_output_stays_clean_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, err = _terminal(monkeypatch)
    root = _root(tmp_path)
    assert main(["verify", str(root), "--json"]) == EXIT_OK
    assert json.loads(out.getvalue())["ok"] is True  # the bar went to stderr only
    assert "verify: 100%" in err.getvalue()


def test_ctrl_c_closes_the_bar_and_exits_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, err = _terminal(monkeypatch)
    root = _root(tmp_path)
    real = Bar.__call__

    def interrupted(self: Bar, done: int, total: int, what: str = "") -> None:
        real(self, done, total, what)
        raise KeyboardInterrupt

    monkeypatch.setattr(Bar, "__call__", interrupted)
    assert main(["verify", str(root)]) == EXIT_INTERRUPTED
    drawn = err.getvalue()
    # The bar's line was ended before the error line, which starts a line of its own.
    assert "verify:" in drawn and "\nerror: interrupted (Ctrl-C)." in drawn


def test_upgrade_draws_a_bar_of_operations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, g1_checkpoint: Path
) -> None:
    out, err = _terminal(monkeypatch)
    assert main(["upgrade", str(g1_checkpoint)]) == EXIT_OK
    assert "upgrade: 100%" in err.getvalue() and "op/s" in err.getvalue()
    assert "upgrade:" not in out.getvalue()


@pytest.fixture
def g1_checkpoint(tmp_path: Path) -> Path:
    """A copy of a real tensordict 0.2.1 (G1, meta.pt) checkpoint, which upgrade rewrites."""
    return copy_case(tmp_path, "0.2.1", "nested")


# -- the library API: progress=True / a callable ---------------------------------------------


def test_manager_save_reports_every_byte_it_writes(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    with CheckpointManager(tmp_path / "run") as mgr:
        path = mgr.save(
            1,
            TensorDict(a=torch.arange(1000.0), b={"c": torch.ones(3, 4)}),
            progress=lambda d, t: calls.append((d, t)),
        )
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    written = sum(f["size"] for f in manifest["files"])
    assert calls and calls[-1] == (written, written)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)  # never goes back
    assert {t for _, t in calls} == {written}


def test_save_progress_true_draws_only_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    err = _Tty()
    monkeypatch.setattr(sys, "stderr", err)
    tdckpt.save(TensorDict(a=torch.zeros(256)), tmp_path / "p", progress=True)
    assert "save: 100%" in err.getvalue() and err.getvalue().endswith("\n")
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    tdckpt.save(TensorDict(a=torch.zeros(256)), tmp_path / "q", progress=True)
    assert piped.getvalue() == ""


def test_verify_progress_true_and_a_bad_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _root(tmp_path)
    err = _Tty()
    monkeypatch.setattr(sys, "stderr", err)
    with CheckpointManager(root) as mgr:
        assert mgr.verify(progress=True).ok
        with pytest.raises(TypeError, match="progress must be True, False, None or a callable"):
            mgr.verify(progress="yes")  # type: ignore[arg-type]
    assert "verify: 100%" in err.getvalue()
