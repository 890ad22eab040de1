"""``tdckpt ls`` / ``verify`` / ``gc`` over a checkpoint root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tdckpt import CheckpointManager
from tdckpt.cli import main


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    td = TensorDict(
        w=torch.arange(6.0).reshape(3, 2), nested=TensorDict(b=torch.ones(3)), batch_size=[3]
    )
    with CheckpointManager(root) as mgr:
        mgr.save(10, td, metadata={"loss": 0.5})
        mgr.save(20, td, metadata={"loss": 0.25})
    (root / ("30.tmp-" + "ab" * 16)).mkdir()  # what a crashed save leaves behind
    return root


def test_ls_json_lists_committed_and_incomplete(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [
        (10, "committed"),
        (20, "committed"),
        (30, "incomplete"),
    ]
    assert rows[0]["metadata"] == {"loss": 0.5}
    assert rows[0]["format_version"] == 1 and rows[0]["key_encoding"] == "robust"
    assert rows[0]["size"] > 0


def test_ls_text(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "incomplete" in out and '"loss": 0.25' in out


def test_verify_ok_then_names_a_flipped_byte(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(root), "--step", "10"]) == 0
    assert "OK" in capsys.readouterr().out
    leaf = root / "10" / "w.memmap"
    data = bytearray(leaf.read_bytes())
    data[0] ^= 0xFF
    leaf.write_bytes(bytes(data))
    assert main(["verify", str(root), "--step", "10", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert any(p["path"] == "w.memmap" and p["kind"] == "changed" for p in report["problems"])


def test_gc_removes_leftovers_only(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gc", str(root)]) == 0
    assert "1 stale" in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["10", "20"]


def test_verify_missing_step_is_one_error_line(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(root), "--step", "99"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "99" in err[0]
