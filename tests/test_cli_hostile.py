"""Every ``tdckpt`` command on hostile and wrong input: never a traceback.

The commands, their positional arguments and their options are read from the argparse
parser itself, so a new command (or flag) is driven through the same table automatically.
For each run: the exit code is 0, 1 or 2; no ``Traceback`` anywhere; a failure prints
exactly one line starting with ``error:`` on stderr (a success none); ``--json`` output is
one valid JSON document, and a failure under ``--json`` is either the report with
``"ok": false`` or the stable ``{"error": {...}}`` object; the read-only commands leave
their input byte-identical.

The big table runs in-process with stdout and stderr as strict ASCII streams (so any
name the terminal cannot show would raise UnicodeEncodeError); a few real
``python -m tdckpt`` children cover what only a process has: ``PYTHONIOENCODING=ascii``,
``LC_ALL=C``, a reader that closed the pipe, a closed stdout, a real SIGINT. Permission
errors run in a forked child that drops root (the suite runs as root).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import copy_case, subprocess_env, tree_digest
from tensordict import TensorDict

from tdckpt import CheckpointManager, cli
from tdckpt._cli.output import _clean

READ_ONLY = {"inspect", "validate", "ls", "verify"}  # anything else gets a fresh input per run


# -- running the CLI -------------------------------------------------------------------------


@dataclass
class Result:
    argv: list[str]
    code: int
    out: str
    err: str

    def __str__(self) -> str:
        return (
            f"tdckpt {self.argv!r} -> {self.code}\n"
            f"--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-3000:]}"
        )


def _strict_ascii() -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict", newline="\n")


def run_cli(argv: list[str]) -> Result:
    """``cli.main(argv)`` with stdout/stderr as strict ASCII streams; the exit code and output."""
    out, err = _strict_ascii(), _strict_ascii()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: object = cli.main(argv)
        except SystemExit as exc:  # --help and usage errors, as argparse does
            code = exc.code
    texts = []
    for stream in (out, err):
        stream.flush()
        texts.append(stream.buffer.getvalue().decode("ascii"))  # type: ignore[attr-defined]
    assert isinstance(code, int), f"exit code {code!r} for {argv!r}"
    return Result(argv, code, texts[0], texts[1])


def check(res: Result, *, allow_internal: bool = False) -> None:
    """The promises every run keeps, whatever the input."""
    assert res.code in (0, 1, 2), res
    assert "Traceback" not in res.out and "Traceback" not in res.err, res
    error_lines = [ln for ln in res.err.splitlines() if ln.startswith("error:")]
    if res.code == 0:
        assert error_lines == [], res
    else:
        assert len(error_lines) == 1, res
        assert len(error_lines[0]) > len("error: ") + 10, res
    if not allow_internal:
        assert "internal error" not in res.err, res
    for text in (res.out, res.err):  # nothing for a terminal to interpret
        assert all(ch == "\n" or ch.isprintable() for ch in text), res
    if "--json" in res.argv and "--help" not in res.argv and "-h" not in res.argv:
        data = json.loads(res.out)  # one document, nothing else on stdout
        if res.code != 0:
            assert isinstance(data, dict), res
            if "error" in data:
                error = data["error"]
                assert set(error) == {"type", "message", "path", "exit_code", "details"}, res
                assert error["exit_code"] == res.code and error["message"], res
                shown = _clean(error["message"].splitlines()[0])
                assert shown.encode("ascii", "backslashreplace").decode() in error_lines[0], res
            else:
                assert data.get("ok") is False, res


# -- the parser, enumerated ------------------------------------------------------------------


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


SUBCOMMANDS = _subparsers()
_GENERIC = {"help", "traceback", "json"}


def _positionals(name: str) -> list[str]:
    return [a.dest for a in SUBCOMMANDS[name]._actions if not a.option_strings]


def _flags(name: str) -> list[str]:
    return [
        a.option_strings[-1]
        for a in SUBCOMMANDS[name]._actions
        if isinstance(a, argparse._StoreTrueAction) and a.dest not in _GENERIC
    ]


def _valued(name: str) -> list[argparse.Action]:
    return [
        a
        for a in SUBCOMMANDS[name]._actions
        if a.option_strings
        and a.nargs is None
        and not isinstance(a, argparse._StoreTrueAction)
        and not isinstance(a, argparse._HelpAction)
    ]


def _has_json(name: str) -> bool:
    return any(a.dest == "json" for a in SUBCOMMANDS[name]._actions)


def variants(name: str) -> list[list[str]]:
    """Plain, and (where the command has --json) every flag and option choice with --json."""
    json_ = ["--json"] if _has_json(name) else []
    out: list[list[str]] = [[]]
    if json_:
        out.append(json_)
    out += [[flag, *json_] for flag in _flags(name)]
    for action in _valued(name):
        for choice in action.choices or ():
            out.append([action.option_strings[-1], str(choice), *json_])
    return out


def test_the_table_covers_every_command_and_flag() -> None:
    # The parametrization below is built from the parser: make sure it saw them all.
    assert set(SUBCOMMANDS) >= {"inspect", "validate", "upgrade", "ls", "verify", "gc", "demo"}
    assert _positionals("inspect") == ["prefix"] and _positionals("ls") == ["root"]
    assert set(_flags("upgrade")) == {"--dry-run", "--no-backup", "--convert-pickles"}
    assert ["--robust-key", "false", "--json"] in variants("validate")
    assert [a.dest for a in _valued("verify")] == ["step", "storage_option"]
    assert sorted(a.dest for a in _valued("gc")) == ["grace_period", "storage_option"]


# -- hostile inputs --------------------------------------------------------------------------


def _td() -> TensorDict:
    return TensorDict(
        w=torch.arange(6.0).reshape(3, 2), nested=TensorDict(b=torch.ones(3)), batch_size=[3]
    )


def _manager_root(base: Path) -> Path:
    root = base / "run"
    with CheckpointManager(root, fsync=False) as mgr:
        mgr.save(10, _td(), metadata={"loss": 0.5})
        mgr.save(20, _td(), metadata={"loss": 0.125, "note": "caf\u00e9 \x1b[2J"})
    (root / ("30.tmp-" + "ab" * 16)).mkdir()  # what a crashed save leaves
    # save refuses NaN; a manifest written by hand may still hold one (Python's json reads it)
    manifest = root / "20" / "tdckpt.manifest.json"
    text = manifest.read_text()
    # (the quoted key too: the manifest's "created" time may hold the digits 0.125 as well)
    assert text.count('"loss": 0.125') == 1
    manifest.write_text(text.replace('"loss": 0.125', '"loss": NaN'))
    return root


def _with_meta(base: Path, raw: bytes) -> Path:
    prefix = copy_case(base, "0.15.3", "nested")
    (prefix / "meta.json").write_bytes(raw)
    return prefix


def _edit_meta(base: Path, edit: Callable[[dict[str, object]], None]) -> Path:
    prefix = copy_case(base, "0.15.3", "nested")
    meta = json.loads((prefix / "meta.json").read_text())
    edit(meta)
    (prefix / "meta.json").write_text(json.dumps(meta))
    return prefix


def _hostile_keys(base: Path) -> Path:
    """Keys a terminal must not see raw: an ESC sequence, a newline, a file name that is not
    UTF-8 (surrogate-escaped when read), a lone surrogate (its file cannot exist)."""
    prefix = base / "keys"
    TensorDict(
        {
            "esc\x1b[31mred": torch.zeros(2),
            "new\nline": torch.ones(2),
            "plain": torch.ones(2),
            "caf\u00e9": torch.ones(2),
        },
        [],
    ).memmap(prefix, robust_key=False)
    meta = json.loads((prefix / "meta.json").read_text())
    meta["caf\udce9"] = meta.pop("plain")
    meta["lone\ud800"] = dict(meta["caf\udce9"])
    (prefix / "meta.json").write_text(json.dumps(meta))  # JSON escapes both surrogates
    os.rename(prefix / "plain.memmap", os.fsencode(prefix) + b"/caf\xe9.memmap")
    return prefix


def _damaged_root(base: Path) -> Path:
    root = _manager_root(base)
    (root / "10" / "tdckpt.manifest.json").write_text("{garbage")
    (root / "40.tdz").write_bytes(b"PK\x03\x04 not really a zip")
    (root / "50").write_text("a file where a step folder should be")
    leaf = root / "20" / "w.memmap"
    leaf.write_bytes(leaf.read_bytes()[:-1])
    return root


def _symlink(base: Path, target: str | Path, name: str = "link") -> Path:
    link = base / name
    link.symlink_to(target)
    return link


def _planted_journal(base: Path, content: bytes) -> Path:
    prefix = copy_case(base, "0.3.2", "nested")
    (prefix.parent / f"{prefix.name}.tdckpt-upgrade.journal").write_bytes(content)
    return prefix


def _odd_dir_name(base: Path) -> Path:
    parent = base / "we\nird\x1b[2J"
    parent.mkdir()
    shutil.copytree(copy_case(base, "0.15.3", "nested"), parent / "ckpt")
    return parent / "ckpt"


def _non_utf8_dir(base: Path) -> Path:
    target = Path(os.fsdecode(os.fsencode(base) + b"/caf\xe9"))
    shutil.copytree(copy_case(base, "0.15.3", "flat"), target)
    return target


def _truncated_archive(base: Path) -> Path:
    archive = copy_case(base, "0.15.3", "archive_stored")
    os.truncate(archive, archive.stat().st_size // 2)
    return archive


def _file(base: Path, name: str, data: bytes) -> Path:
    path = base / name
    path.write_bytes(data)
    return path


def _dir(base: Path, name: str) -> Path:
    path = base / name
    path.mkdir()
    return path


def _meta_dir(base: Path) -> Path:
    prefix = copy_case(base, "0.15.3", "nested")
    (prefix / "meta.json").unlink()
    (prefix / "meta.json").mkdir()
    return prefix


def _meta_fifo(base: Path) -> Path:
    prefix = copy_case(base, "0.15.3", "nested")
    (prefix / "lvl1" / "meta.json").unlink()
    os.mkfifo(prefix / "lvl1" / "meta.json")  # opening it would block forever
    return prefix


def _meta_symlink(base: Path) -> Path:
    prefix = copy_case(base, "0.15.3", "flat")
    (prefix / "meta.json").unlink()
    (prefix / "meta.json").symlink_to("/etc/passwd")
    return prefix


def _lock_dir(base: Path) -> Path:
    root = _manager_root(base)
    (root / ".tdckpt.lock").mkdir()
    return root


def _lock_garbage(base: Path) -> Path:
    root = _manager_root(base)
    lock = root / ".tdckpt.lock"
    lock.write_bytes(b"\xff\xfe{not json")
    old = time.time() - 3600  # not a lock being created right now: taken over at once
    os.utime(lock, (old, old))
    return root


#: name -> what builds it under a fresh folder: the path argument, and the working folder
#: (None: unchanged) for the relative ones.
Builder = Callable[[Path], "tuple[str, Path | None]"]


def _abs(build: Callable[[Path], Path]) -> Builder:
    return lambda base: (str(build(base)), None)


INPUTS: dict[str, Builder] = {
    "valid": _abs(lambda b: copy_case(b, "0.15.3", "nested")),
    "legacy-0.3.2": _abs(lambda b: copy_case(b, "0.3.2", "nested")),
    "legacy-meta.pt": _abs(lambda b: copy_case(b, "0.2.1", "nested")),
    "archive": _abs(lambda b: copy_case(b, "0.15.3", "archive_deflate")),
    "pickles": _abs(lambda b: copy_case(b, "0.15.3", "non_tensor_pickle")),
    "truncated-archive": _abs(_truncated_archive),
    "garbage-archive": _abs(lambda b: _file(b, "x.tdz", os.urandom(4096))),
    "empty-file": _abs(lambda b: _file(b, "empty", b"")),
    "text-file": _abs(lambda b: _file(b, "notes.txt", b"hello\n")),
    "missing": _abs(lambda b: b / "absent"),
    "missing-parent": _abs(lambda b: b / "absent" / "deeper"),
    "under-a-file": _abs(lambda b: _file(b, "f", b"x") / "sub"),
    "empty-dir": _abs(lambda b: _dir(b, "empty")),
    "garbage-json": _abs(lambda b: _with_meta(b, b"{not json")),
    "binary-json": _abs(lambda b: _with_meta(b, b"\xff\xfe\x00\x80garbage")),
    "json-list": _abs(lambda b: _with_meta(b, b"[]")),
    "json-deep": _abs(lambda b: _with_meta(b, b"[" * 100_000 + b"]" * 100_000)),
    "json-huge-shape": _abs(lambda b: _edit_meta(b, lambda m: m.update(shape=[10**40]))),
    "json-negative-shape": _abs(lambda b: _edit_meta(b, lambda m: m.update(shape=[-3]))),
    "json-nan-shape": _abs(lambda b: _with_meta(b, b'{"shape": [NaN], "device": "cpu"}')),
    "meta-is-dir": _abs(_meta_dir),
    "meta-fifo": _abs(_meta_fifo),
    "meta-symlink-outside": _abs(_meta_symlink),
    "prefix-symlink": _abs(lambda b: _symlink(b, copy_case(b, "0.3.2", "nested"))),
    "symlink-loop": _abs(lambda b: _symlink(b, b / "loop", "loop")),
    "dangling-symlink": _abs(lambda b: _symlink(b, b / "nowhere")),
    "hostile-keys": _abs(_hostile_keys),
    "odd-dir-name": _abs(_odd_dir_name),
    "non-utf8-dir": _abs(_non_utf8_dir),
    "manager-root": _abs(_manager_root),
    "manager-step": _abs(lambda b: _manager_root(b) / "20"),
    "damaged-root": _abs(_damaged_root),
    "lock-is-a-dir": _abs(_lock_dir),
    "garbage-lock": _abs(_lock_garbage),
    "planted-journal": _abs(lambda b: _planted_journal(b, b'{"version": 1, "phase": "staged"}')),
    "garbage-journal": _abs(lambda b: _planted_journal(b, b"\x00\xffnot json")),
    "long-name": _abs(lambda b: b / ("x" * 300)),
    "long-path": _abs(lambda b: b / ("d/" * 3000)),
    "dash-path": lambda b: ("-rf", None),
    "dot": lambda b: (".", copy_case(b, "0.3.2", "nested")),
    "dotdot": lambda b: ("..", copy_case(b, "0.3.2", "nested") / "lvl1"),
    "file-system-root": lambda b: ("/", None),
}

#: Inputs a command is not run on, with the reason.
SKIP = {
    ("gc", "file-system-root"): "gc takes the writer lock in the folder: not in /",
}


def _cases() -> list[object]:
    out: list[object] = []
    for name in sorted(SUBCOMMANDS):
        if not _positionals(name):
            continue
        for what in INPUTS:
            if (name, what) in SKIP:
                continue
            out.append(pytest.param(name, what, id=f"{name}-{what}"))
    return out


@contextlib.contextmanager
def _cwd(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _snapshot(root: Path) -> dict[str, str]:
    """Like ``tree_digest``, but a FIFO or socket is recorded by type, never opened."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            path = Path(dirpath) / name
            info = path.lstat()
            rel = path.relative_to(root).as_posix()
            if stat.S_ISREG(info.st_mode):
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(info.st_mode):
                out[rel] = f"symlink:{os.readlink(path)}"
            else:
                out[rel] = f"mode:{stat.S_IFMT(info.st_mode)}"
    return out


def _digest(arg: str, cwd: Path | None) -> dict[str, str] | None:
    path = Path(cwd or ".") / arg
    try:
        if arg == "/" or not path.exists() or path.is_symlink():
            return None
    except OSError:  # a name too long to stat
        return None
    return tree_digest(path) if path.is_file() else _snapshot(path)


@pytest.mark.parametrize(("command", "what"), _cases())
def test_every_command_on_hostile_input(command: str, what: str, tmp_path: Path) -> None:
    build = INPUTS[what]
    shared: tuple[str, Path | None] | None = None
    for i, extra in enumerate(variants(command)):
        if command in READ_ONLY:
            if shared is None:
                base = tmp_path / "in"
                base.mkdir()
                shared = build(base)
            arg, cwd = shared
        else:
            base = tmp_path / f"in{i}"
            base.mkdir()
            arg, cwd = build(base)
        argv = [command, arg, *extra]
        with _cwd(cwd):
            before = _digest(arg, cwd) if command in READ_ONLY else None
            res = run_cli(argv)
            check(res)
            if before is not None:
                assert _digest(arg, cwd) == before, f"{res}\n{command} changed its input"


# -- options with wrong values ---------------------------------------------------------------

HOSTILE_STEPS = [
    "-1",
    "-0",
    "abc",
    "",
    " 5",
    "5 ",
    "+5",
    "1_000",
    "0x10",
    "1e3",
    "\u0663",
    "5\n",
    "\udce9",
    "1" + "0" * 40,
    "9" * 5000,
    "3.0",
    "--",
    "0",
    "007",
    "20",
]
HOSTILE_VALUES = ["", "-1", "maybe", "TRUE", "\udce9", "\x1b[2J", "x" * 10_000]


def _valid_input(command: str, base: Path) -> str:
    return str(
        _manager_root(base)
        if _positionals(command) == ["root"]
        else copy_case(base, "0.15.3", "nested")
    )


@pytest.mark.parametrize("command", [c for c in sorted(SUBCOMMANDS) if _valued(c)])
def test_option_values(command: str, tmp_path: Path) -> None:
    arg = _valid_input(command, tmp_path)
    for action in _valued(command):
        values = HOSTILE_STEPS if action.dest == "step" else HOSTILE_VALUES
        for value in values:
            for extra in ([], ["--json"]):
                res = run_cli([command, arg, action.option_strings[-1], value, *extra])
                check(res)
        res = run_cli([command, arg, action.option_strings[-1]])  # the value missing
        check(res)
        assert res.code == 2


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_wrong_usage(command: str, tmp_path: Path) -> None:
    arg = _valid_input(command, tmp_path) if _positionals(command) else "x"
    wrong = [
        [command, "--frobnicate"],
        [command, arg, arg, "extra"],
        [command, "--json", "--frobnicate"],
        [command, *(["--json"] if _has_json(command) else []), "\udce9", "\x1b[2J", "x"],
    ]
    if _positionals(command):
        wrong += [[command], [command, "--json"], [command, ""], [command, "", "--json"]]
    for argv in wrong:
        res = run_cli(argv)
        check(res)
        assert res.code == 2, res
        assert res.err.startswith("usage: tdckpt"), res
    for argv in ([command, "--help"], [command, "-h", "--json"]):
        res = run_cli(argv)
        check(res)
        assert res.code == 0 and "exit codes:" in res.out, res


def test_top_level_usage() -> None:
    for argv in ([], ["bogus"], ["--json"], ["--traceback"], ["\udce9"], ["--frob", "ls"]):
        res = run_cli(argv)
        check(res)
        assert res.code == 2, res
    res = run_cli(["--help"])
    assert res.code == 0
    for line in ("0    success", "1    a problem", "2    bad usage", "130  interrupted"):
        assert line in res.out
    for name in SUBCOMMANDS:
        assert name in res.out


def test_demo_runs(tmp_path: Path) -> None:
    res = run_cli(["demo"])
    check(res)
    assert res.code == 0 and "weights match: True" in res.out, res


# -- what the errors say ---------------------------------------------------------------------


def _error_line(res: Result) -> str:
    [line] = [ln for ln in res.err.splitlines() if ln.startswith("error:")]
    return line


def test_negative_and_malformed_steps_are_usage_errors(tmp_path: Path) -> None:
    root = _manager_root(tmp_path)
    for step in ("-1", "abc", "1e3", "\u0663"):
        res = run_cli(["verify", str(root), "--step", step])
        check(res)
        assert res.code == 2 and "invalid step" in _error_line(res), res
    huge = "1" + "0" * 40  # past the largest step, 2**63 - 1: a usage error
    res = run_cli(["verify", str(root), "--step", huge])
    check(res)
    assert res.code == 2 and "the largest step is 2**63 - 1" in _error_line(res), res
    largest = str(2**63 - 1)
    res = run_cli(["verify", str(root), "--step", largest, "--json"])
    check(res)
    assert res.code == 1
    error = json.loads(res.out)["error"]
    assert error["type"] == "CheckpointNotFoundError" and largest in error["message"]
    assert error["path"] == str(root) and error["details"]["step"] == int(largest)
    assert run_cli(["verify", str(root), "--step", "007"]).code == 1  # no step 7
    assert run_cli(["verify", str(root), "--step", "20"]).code == 0


def test_roots_and_prefixes_are_not_confused(tmp_path: Path) -> None:
    root = _manager_root(tmp_path)
    for command in ("ls", "verify", "gc"):
        before = tree_digest(root / "20")
        res = run_cli([command, str(root / "20")])
        check(res)
        assert res.code == 1 and "is a checkpoint (it holds meta.json)" in _error_line(res), res
        assert f"perhaps {root}" in _error_line(res)
        assert tree_digest(root / "20") == before  # gc took no lock inside the checkpoint
        for missing in (tmp_path / "absent", root / "20" / "w.memmap"):
            res = run_cli([command, str(missing), "--json"])
            check(res)
            assert res.code == 1 and json.loads(res.out)["error"]["path"] == str(missing), res
    assert not (tmp_path / "absent").exists()  # gc created nothing
    for command in ("inspect", "upgrade"):
        res = run_cli([command, str(root)])
        check(res)
        assert res.code == 1 and f"use `tdckpt ls {root}`" in _error_line(res), res
        assert os.path.join(str(root), "20") in _error_line(res)
    res = run_cli(["validate", str(root)])
    check(res)
    assert res.code == 1 and f"use `tdckpt ls {root}`" in res.out


def test_validate_and_verify_problems_also_say_error_on_stderr(tmp_path: Path) -> None:
    root = _damaged_root(tmp_path)
    res = run_cli(["verify", str(root), "--step", "20", "--json"])
    check(res)
    assert res.code == 1 and json.loads(res.out)["ok"] is False
    assert "step 20" in _error_line(res) and "differ" in _error_line(res)
    res = run_cli(["validate", str(root / "20")])
    check(res)
    assert res.code == 1 and "cannot be restored: 1 error(s)" in _error_line(res), res


def test_upgrade_dot_upgrades_the_folder_it_is_run_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the journal and staging tree were written inside the checkpoint, then the
    # swap failed (EBUSY renaming "."), leaving the checkpoint with foreign files in it.
    prefix = copy_case(tmp_path, "0.3.2", "nested")
    monkeypatch.chdir(prefix)
    res = run_cli(["upgrade", ".", "--json"])
    check(res)
    assert res.code == 0, res
    report = json.loads(res.out)
    assert report["prefix"] == str(prefix.resolve()) and report["from_generation"] == "G2"
    assert sorted(p.name for p in prefix.iterdir()) == [
        "lvl1",
        "meta.json",
        "sibling",
        "tdckpt.manifest.json",
        "top.memmap",
    ]
    backups = [p for p in prefix.parent.iterdir() if ".tdckpt-backup-" in p.name]
    assert len(backups) == 1 and not (backups[0] / "tdckpt.manifest.json").exists()
    monkeypatch.chdir(prefix / "lvl1")
    res = run_cli(["upgrade", "..", "--json"])
    check(res)
    assert res.code == 0 and json.loads(res.out)["operations"] == [], res  # already current
    assert not list((prefix / "lvl1").glob("*tdckpt*"))


def test_upgrade_of_the_file_system_root_is_refused_at_once() -> None:
    started = time.monotonic()
    res = run_cli(["upgrade", "/", "--json"])
    check(res)
    assert res.code == 1 and json.loads(res.out)["error"]["type"] == "UnsafePathError"
    for command in ("inspect", "validate"):  # refused before any sub-folder is walked
        res = run_cli([command, "/"])
        check(res)
        assert res.code == 1 and "no meta.json" in (res.err + res.out)
    assert time.monotonic() - started < 20


def test_upgrade_json_failure_is_json_with_a_nonzero_exit(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.15.3", "nested")
    os.truncate(prefix / "lvl1" / "x.memmap", 3)
    before = tree_digest(prefix)
    res = run_cli(["upgrade", str(prefix), "--json"])
    check(res)
    assert res.code == 1
    error = json.loads(res.out)["error"]
    assert error["type"] == "ValidationError"
    assert any(p["path"] == "lvl1/x.memmap" for p in error["details"]["problems"])
    assert tree_digest(prefix) == before


def test_names_a_terminal_cannot_show_are_escaped(tmp_path: Path) -> None:
    prefix = _hostile_keys(tmp_path)
    res = run_cli(["inspect", str(prefix)])
    check(res)
    assert res.code == 0, res
    for shown in ("esc\\x1b[31mred", "new\\nline", "caf\\udce9", "caf\\xe9"):
        assert shown in res.out, res
    res = run_cli(["inspect", str(prefix), "--json"])
    keys = [c["key"][0] for c in json.loads(res.out)["tree"]["children"]]
    assert "caf\udce9" in keys and "esc\x1b[31mred" in keys  # JSON keeps the exact name


def test_ls_json_with_nan_metadata_is_strict_json(tmp_path: Path) -> None:
    root = _manager_root(tmp_path)
    res = run_cli(["ls", str(root), "--json"])
    check(res)
    rows = json.loads(res.out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert rows[1]["metadata"]["loss"] == "nan"
    res = run_cli(["ls", str(root)])
    assert '"note": "caf\\u00e9 \\u001b[2J"' in res.out  # the text view escapes it too


def test_warnings_are_one_line(tmp_path: Path) -> None:
    root = _lock_garbage(tmp_path)
    res = run_cli(["gc", str(root)])
    check(res)
    warning_lines = [ln for ln in res.err.splitlines() if ln.startswith("warning:")]
    assert res.code == 0 and len(warning_lines) == 1, res
    assert "lock" in warning_lines[0]


def test_traceback_option_after_the_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        cli.main(["ls", str(tmp_path / "absent"), "--traceback"])
    with pytest.raises(FileNotFoundError):
        cli.main(["--traceback", "ls", str(tmp_path / "absent")])


def test_an_unexpected_exception_is_reported_as_a_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tdckpt import manager

    def broken(self: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(manager.CheckpointManager, "list_steps", broken)
    root = _manager_root(tmp_path)
    res = run_cli(["ls", str(root), "--json"])
    check(res, allow_internal=True)
    assert res.code == 2
    assert "internal error" in _error_line(res) and "--traceback" in _error_line(res)
    assert json.loads(res.out)["error"]["type"] == "InternalError"
    with pytest.raises(ZeroDivisionError):
        cli.main(["--traceback", "ls", str(root)])


def test_interrupt_in_process_is_exit_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_ls", interrupted)
    res = run_cli(["ls", str(tmp_path), "--json"])
    assert res.code == 130 and _error_line(res) == "error: interrupted (Ctrl-C).", res
    assert json.loads(res.out)["error"]["exit_code"] == 130


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_to_a_full_device(tmp_path: Path) -> None:
    root = _manager_root(tmp_path)
    for extra in ([], ["--json"]):
        err = _strict_ascii()
        full = open("/dev/full", "w", encoding="ascii")  # noqa: SIM115 - closed below
        try:
            with contextlib.redirect_stdout(full), contextlib.redirect_stderr(err):
                code = cli.main(["ls", str(root), *extra])
        finally:
            with contextlib.suppress(OSError):
                full.close()
        err.flush()
        res = Result(["ls", str(root), *extra], code, "", err.buffer.getvalue().decode("ascii"))  # type: ignore[attr-defined]
        assert res.code == 1, res
        assert _error_line(res).startswith("error: <standard output>: No space left"), res


# -- as another user (the suite runs as root) ------------------------------------------------


def run_unprivileged(argv: list[str]) -> Result:
    """``run_cli(argv)`` in a forked child that drops root to uid/gid 65534."""
    if os.geteuid() != 0:
        return run_cli(argv)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        try:
            os.close(read_fd)
            os.setgid(65534)
            os.setuid(65534)
            from tdckpt._read import directory

            cached = getattr(directory, "_effective_uid", None)
            if cached is not None and hasattr(cached, "cache_clear"):
                cached.cache_clear()
            outcome: object = run_cli(argv)
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        try:
            with os.fdopen(write_fd, "wb") as fh:
                pickle.dump(outcome, fh)
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    outcome = pickle.loads(data)
    assert isinstance(outcome, Result), outcome
    return outcome


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A folder any user can reach (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="tdckpt-cli-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        for dirpath, dirnames, _ in os.walk(base):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)
        shutil.rmtree(base)


def test_permission_denied_everywhere(shared_base: Path) -> None:
    legacy = copy_case(shared_base / "a", "0.3.2", "nested")
    unreadable_meta = copy_case(shared_base / "b", "0.15.3", "nested")
    (unreadable_meta / "meta.json").chmod(0o000)
    unreadable_sub = copy_case(shared_base / "c", "0.15.3", "nested")
    (unreadable_sub / "lvl1").chmod(0o000)
    closed = copy_case(shared_base / "d", "0.15.3", "nested")
    closed.chmod(0o000)
    root = _manager_root(shared_base / "e")
    (root / "10" / "w.memmap").chmod(0o000)
    (root / "20" / "tdckpt.manifest.json").chmod(0o000)
    for d in (
        shared_base / "a",
        shared_base / "b",
        shared_base / "c",
        shared_base / "d",
        shared_base / "e",
    ):
        for dirpath, _, _ in os.walk(d):
            if Path(dirpath) not in (unreadable_sub / "lvl1", closed):
                os.chmod(dirpath, 0o755)
    read_only_root = _manager_root(shared_base / "f")
    os.chmod(shared_base / "f", 0o755)
    for dirpath, _, files in os.walk(shared_base / "f"):
        os.chmod(dirpath, 0o555)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o444)
    os.chmod(legacy.parent, 0o555)  # the upgrade cannot put its journal beside the prefix

    before = tree_digest(legacy)
    runs = [
        *(["inspect", str(p)] for p in (unreadable_meta, unreadable_sub, closed, legacy)),
        *(["validate", str(p), "--json"] for p in (unreadable_meta, unreadable_sub, closed)),
        ["upgrade", str(legacy)],
        ["upgrade", str(legacy), "--json"],
        ["upgrade", str(unreadable_sub), "--dry-run"],
        ["ls", str(root)],
        ["verify", str(root), "--step", "10"],
        ["verify", str(root), "--step", "20", "--json"],
        ["gc", str(read_only_root)],
        ["gc", str(read_only_root), "--json"],
        ["ls", str(closed)],
    ]
    results = [run_unprivileged(argv) for argv in runs]
    for res in results:
        check(res)
    by_argv = {tuple(r.argv): r for r in results}
    assert by_argv[("inspect", str(legacy))].code == 0  # readable: fine
    for argv in (("upgrade", str(legacy)), ("gc", str(read_only_root))):
        res = by_argv[argv]
        assert res.code == 1 and "ermission denied" in _error_line(res), res
    assert by_argv[("inspect", str(unreadable_meta))].code == 1
    assert tree_digest(legacy) == before


# -- real processes: encodings, pipes, signals -----------------------------------------------


def _module(
    *argv: str, env: dict[str, str] | None = None, **kw: object
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-m", "tdckpt", *argv],
        capture_output=True,
        env=env or subprocess_env(),
        timeout=180,
        check=False,
        **kw,
    )


def _check_process(rc: int, out: bytes, err: bytes, argv: list[str]) -> Result:
    res = Result(argv, rc, out.decode("ascii"), err.decode("ascii"))  # ASCII: all escaped
    check(res)
    assert b"Exception ignored" not in err, res
    return res


@pytest.mark.parametrize(
    "env_change",
    [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": None}],
    ids=["PYTHONIOENCODING=ascii", "LC_ALL=C"],
)
def test_process_on_a_narrow_terminal(env_change: dict[str, str | None], tmp_path: Path) -> None:
    prefix = _hostile_keys(tmp_path)
    env = subprocess_env()
    for name, value in env_change.items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    env.pop("PYTHONUTF8", None)
    argv = ["validate", str(prefix)] if "LC_ALL" in env_change else ["inspect", str(prefix)]
    proc = _module(*argv, env=env)
    res = _check_process(proc.returncode, proc.stdout, proc.stderr, argv)
    if argv[0] == "inspect":
        assert "caf\\udce9" in res.out and "esc\\x1b[31mred" in res.out, res
    else:  # the one error: a key that is a lone surrogate (its file cannot exist)
        assert res.code == 1 and "[lone\\ud800]" in res.out, res


def test_process_whose_reader_closed_the_pipe(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.15.3", "nested")
    argv = ["inspect", str(prefix)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tdckpt", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head -0`: gone before the first line is written
    with proc.stderr:
        err = proc.stderr.read()
    rc = proc.wait(timeout=180)
    res = _check_process(rc, b"", err, argv)
    assert res.code == 1 and "broken pipe" in _error_line(res), res


def test_process_with_stdout_closed(tmp_path: Path) -> None:
    root = _manager_root(tmp_path)
    argv = ["ls", str(root), "--json"]
    proc = subprocess.run(
        ["sh", "-c", 'exec "$0" -m tdckpt "$@" >&-', sys.executable, *argv],
        capture_output=False,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
        timeout=180,
        check=False,
    )
    # Python starts with sys.stdout None: nothing to print to, nothing to fail on.
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr


def test_process_interrupted_by_a_real_sigint(tmp_path: Path) -> None:
    root = _manager_root(tmp_path)
    code = (
        "import os, signal, sys\n"
        # Python's own handler, as a terminal starts it: a runner's background job (`cmd &`
        # without job control) hands SIGINT down ignored, and the child would ignore it too
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from tdckpt import cli\n"
        "real = cli._cmd_ls\n"
        "def slow(args):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(args)\n"
        "cli._cmd_ls = slow\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    argv = ["ls", str(root)]
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        env=subprocess_env(),
        timeout=180,
        check=False,
    )
    assert proc.returncode == 130, proc.stderr
    err = proc.stderr.decode()
    assert err == "error: interrupted (Ctrl-C).\n" and "Traceback" not in err
