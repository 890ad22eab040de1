"""The ``tdckpt`` command line: verbs, JSON output, exit codes 0/1/2, ``--traceback``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import copy_case, subprocess_env, tree_digest

from tdckpt import cli, inspect, validate
from tdckpt.errors import CheckpointNotFoundError, TdckptError


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_module(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tdckpt", *argv],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=cwd,
        timeout=120,
        check=False,
    )


@pytest.fixture
def nested(tmp_path: Path) -> Path:
    return copy_case(tmp_path, "0.15.3", "nested")


# -- inspect ------------------------------------------------------------------------------


def test_inspect_text(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = tree_digest(nested)
    code, out, err = run(capsys, "inspect", str(nested))
    assert code == 0 and err == ""
    assert f"checkpoint   {nested} (directory)" in out
    assert "generation   G8 (tensordict format v1)" in out
    assert "key encoding robust" in out
    assert "leaves       5, 204 bytes" in out
    assert "top: torch.float32 [3] (12 B)" in out
    assert "lvl1: tensordict tensordict:TensorDict batch=[3, 2]" in out
    assert "z: torch.bool [3, 2, 4, 1] (24 B)" in out
    assert tree_digest(nested) == before


def test_inspect_json(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", str(nested), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["generation"] == "G8"
    assert data["key_encoding"] == "robust"
    assert data["format_version"] == 1
    assert data["storage"] == "directory"
    assert data["leaf_count"] == 5 and data["total_bytes"] == 204
    tree = data["tree"]
    assert tree["kind"] == "tensordict" and tree["batch_size"] == [3]
    names = [c["key"] for c in tree["children"]]
    assert names == [["top"], ["lvl1"], ["sibling"]]
    assert data == json.loads(json.dumps(inspect(nested).to_json(), default=str))


def test_inspect_json_pickles_and_legacy_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pickled = copy_case(tmp_path, "0.15.3", "non_tensor_pickle")
    data = json.loads(run(capsys, "inspect", str(pickled), "--json")[1])
    assert sorted(data["pickles"]) == [["bytes"], ["date"], ["point"], ["set"]]
    code, out, _ = run(capsys, "inspect", str(pickled))
    assert code == 0 and "pickles      date, point, bytes, set" in out

    legacy = copy_case(tmp_path, "0.15.3", "odd_keys__robust_false")
    data = json.loads(run(capsys, "inspect", str(legacy), "--json", "--robust-key", "false")[1])
    assert data["key_encoding"] == "legacy"
    assert ["with space"] in [c["key"] for c in data["tree"]["children"]]


def test_inspect_archive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = copy_case(tmp_path, "0.15.3", "archive_deflate")
    code, out, _ = run(capsys, "inspect", str(archive), "--json")
    assert code == 0
    assert json.loads(out)["storage"] == "archive"


def test_inspect_marks_nested_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = copy_case(tmp_path, "0.15.3", "nested_tensor_strided")
    code, out, _ = run(capsys, "inspect", str(target))
    assert code == 0
    [line] = [ln for ln in out.splitlines() if ln.strip().startswith("nt:")]
    assert "nested" in line


# -- validate -----------------------------------------------------------------------------


def test_validate_ok_exits_0(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "validate", str(nested))
    assert code == 0 and err == ""
    assert out.strip() == f"{nested}: ok, 0 warning(s)"


def test_validate_problem_exits_1(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.truncate(nested / "lvl1" / "x.memmap", 3)
    before = tree_digest(nested)
    code, out, _ = run(capsys, "validate", str(nested))
    assert code == 1
    assert "error: lvl1/x.memmap [lvl1.x]:" in out
    assert out.strip().endswith(f"{nested}: 1 error(s), 0 warning(s)")
    code, out, _ = run(capsys, "validate", str(nested), "--json")
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False
    [problem] = data["problems"]
    assert (problem["code"], problem["path"], problem["key"]) == (
        "short-file",
        "lvl1/x.memmap",
        ["lvl1", "x"],
    )
    assert tree_digest(nested) == before


def test_validate_warning_exits_0(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (nested / "junk").write_text("x")
    code, out, _ = run(capsys, "validate", str(nested))
    assert code == 0
    assert "warning: junk:" in out and "ok, 1 warning(s)" in out


def test_validate_robust_key_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from tensordict import TensorDict

    prefix = tmp_path / "ckpt"
    TensorDict({"a b": torch.zeros(3), "a%20b": torch.ones(3)}, [3]).memmap(
        prefix, robust_key=False
    )
    assert run(capsys, "validate", str(prefix))[0] == 0
    assert run(capsys, "validate", str(prefix), "--robust-key", "false")[0] == 0
    code, out, _ = run(capsys, "validate", str(prefix), "--robust-key", "true")
    assert code == 1 and "resolve to the same file" in out
    assert validate(prefix, robust_key=True).ok is False


def test_validate_nonexistent_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "validate", str(tmp_path / "absent"))
    assert code == 1
    assert "no checkpoint here" in out
    assert "Traceback" not in out + err


# -- errors, usage, help ------------------------------------------------------------------


def test_tdckpt_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for prefix in (tmp_path / "absent", tmp_path):  # no such path; a directory without meta.json
        code, out, err = run(capsys, "inspect", str(prefix))
        assert code == 1
        assert out == ""
        assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
        assert str(prefix) in err


def test_traceback_reraises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        cli.main(["--traceback", "inspect", str(tmp_path / "absent")])
    with pytest.raises(TdckptError, match=r"meta\.json"):
        cli.main(["--traceback", "inspect", str(tmp_path)])


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["validate"],
        ["inspect"],
        ["validate", "x", "--robust-key", "maybe"],
        ["inspect", "x", "--frob"],
    ],
)
def test_usage_error_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tdckpt")
    assert "error:" in err


def test_subcommand_help_is_the_function_summary(capsys: pytest.CaptureFixture[str]) -> None:
    for verb, func in (("inspect", inspect), ("validate", validate)):
        with pytest.raises(SystemExit) as info:
            cli.main([verb, "--help"])
        assert info.value.code == 0
        summary = (func.__doc__ or "").strip().splitlines()[0]
        assert summary in capsys.readouterr().out


def test_python_m_tdckpt(tmp_path: Path) -> None:
    help_ = run_module("--help")
    assert help_.returncode == 0, help_.stderr
    for verb in ("inspect", "validate", "upgrade", "ls", "verify", "gc"):
        assert verb in help_.stdout
    # Each child process imports torch: exit codes 0 and 2 and the one-line error are
    # covered in-process above; here, the module entry point and exit code 1.
    prefix = copy_case(tmp_path, "0.15.3", "flat")
    os.truncate(prefix / "f32.memmap", 1)
    bad = run_module("validate", str(prefix))
    assert bad.returncode == 1, bad.stderr
    assert "f32.memmap" in bad.stdout
    assert "Traceback" not in bad.stderr
