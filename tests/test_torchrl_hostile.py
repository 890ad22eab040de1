"""Hostile TorchRL checkpoint manifests and rotation folders through the CLI: a problem of
the checkpoint (exit 1) or nothing to list, never tdckpt's "internal error" (exit 2).

TorchRL is not needed: each manifest is written by hand.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from tdckpt._interop.torchrl_checkpoint import check_torchrl_checkpoint, rotation_entries
from tdckpt.cli import EXIT_OK, EXIT_PROBLEM, main

FORMAT = "torchrl.checkpoint"
DEEP = "[" * 100_000 + "]" * 100_000


def _checkpoint(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(text)
    return folder


@pytest.mark.parametrize(
    ("manifest", "command", "code", "said"),
    [
        # "versions" is a mapping in TorchRL's manifests
        (
            json.dumps({"format": FORMAT, "versions": [1], "components": {}}),
            "inspect",
            EXIT_OK,
            "versions unreadable",
        ),
        (
            '{"format": "' + FORMAT + '", "components": {"c": ' + DEEP + "}}",
            "validate",
            EXIT_PROBLEM,
            "not a tensordict checkpoint",  # not a TorchRL manifest: read as a prefix
        ),
        (
            json.dumps(
                {
                    "format": FORMAT,
                    "components": {"c": {"adapter": "x", "path": "comp", "files": ["a\x00b"]}},
                }
            ),
            "validate",
            EXIT_PROBLEM,
            "unsafe file entry",
        ),
    ],
)
def test_a_hostile_manifest_is_a_problem_not_a_crash(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    manifest: str,
    command: str,
    code: int,
    said: str,
) -> None:
    path = _checkpoint(tmp_path / "ckpt", manifest)
    assert main([command, str(path)]) == code
    out, err = capsys.readouterr()
    assert "internal error" not in err
    assert said in out + err


def test_a_rotation_folder_with_hostile_entries_lists_the_readable_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ckpt-²`` (``str.isdigit`` says yes, ``int`` says no) and a manifest nested too deep
    are not TorchRL checkpoints of the rotation; the good entry is still listed."""
    root = tmp_path / "rot"
    _checkpoint(root / "ckpt-\u00b2", json.dumps({"format": FORMAT, "components": {}}))
    _checkpoint(root / "ckpt-5", '{"format": "' + FORMAT + '", "components": ' + DEEP + "}")
    _checkpoint(root / "ckpt-7", json.dumps({"format": FORMAT, "components": {}}))
    entries = rotation_entries(root)
    assert entries is not None and [e.step for e in entries] == [7]
    assert main(["ls", str(root)]) == EXIT_OK
    out, err = capsys.readouterr()
    assert "internal error" not in err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["7"]
    # a folder named by superscript digits does not make the root look like tdckpt steps
    (root / "\u00b3").mkdir()
    assert [e.step for e in rotation_entries(root) or []] == [7]


def test_an_archive_member_that_is_also_a_folder_is_named_in_the_archive(tmp_path: Path) -> None:
    """A zip listing both ``a`` and ``a/b``: reported against the member, not as an error
    naming tdckpt's scratch folder."""
    path = tmp_path / "ckpt.torchrl"
    with zipfile.ZipFile(path, "w") as z:
        files = ["a", "a/b"]
        manifest = {
            "format": FORMAT,
            "components": {"c": {"adapter": "x", "path": "comp", "files": files}},
        }
        z.writestr("manifest.json", json.dumps(manifest))
        z.writestr("comp/a", b"1")
        z.writestr("comp/a/b", b"2")
    report = check_torchrl_checkpoint(path)
    assert not report.ok
    (problem,) = [p for p in report.problems if p.code == "unreadable"]
    assert problem.path == "comp/a/b" and "cannot be unpacked" in problem.message
    assert "tdckpt-torchrl-" not in problem.message
