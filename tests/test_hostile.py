"""Hostile checkpoints: every one gives a clear report or a ``TdckptError``, and nothing else.

Each case is run through ``validate``, ``inspect``, ``load_memmap`` and the CLI. None may
raise anything but a ``TdckptError`` (no raw traceback, no RecursionError or MemoryError),
follow a name out of the prefix, open a file outside it, or modify a byte on disk.

"Opened nothing outside" is checked two ways: an audit hook records every ``open`` /
``os.scandir`` / ``os.listdir`` (and a wrapper every ``torch.from_file``) whose path resolves
outside the prefix, and the outside targets hold a distinctive secret that must never show
up in a result or an output.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import sys
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import alarm, copy_case

import tdckpt
from tdckpt import cli, inspect, validate
from tdckpt.errors import TdckptError

SECRET = "TDCKPT-HOSTILE-SECRET-7f3a"
SECRET_BYTES = (SECRET * 4).encode()  # 104 bytes: large enough for any leaf it replaces

# -- watching file access -----------------------------------------------------------------

_WATCH: list[tuple[str, str]] | None = None
_WATCH_ROOT: str = ""
_WATCH_EXCEPT: str = ""


def _outside(real: str) -> bool:
    """Under the watched root, but not under the prefix being read."""

    def under(base: str) -> bool:
        return real == base or real.startswith(base + os.sep)

    return under(_WATCH_ROOT) and not under(_WATCH_EXCEPT)


@functools.lru_cache(maxsize=8192)
def _real_dir(path: str) -> str:
    return os.path.realpath(path)


def _realpath(path: str) -> str:
    # realpath walks every component; directories repeat, so resolve each one once.
    head, tail = os.path.split(os.path.abspath(path))
    full = os.path.join(_real_dir(head), tail)
    return os.path.realpath(full) if os.path.islink(full) else full


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WATCH is None or event not in ("open", "os.scandir", "os.listdir"):
        return
    path = args[0] if args else None
    if isinstance(path, int) or path is None:
        return
    try:
        real = _realpath(os.fsdecode(path))
    except (TypeError, ValueError):  # pragma: no cover - odd path objects
        return
    if _outside(real):
        _WATCH.append((event, real))


sys.addaudithook(_audit)


@contextmanager
def watch_outside(
    outside: Path, prefix: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[tuple[str, str]]]:
    """Record every access to a path under ``outside`` but not under ``prefix``."""
    global _WATCH, _WATCH_ROOT, _WATCH_EXCEPT
    seen: list[tuple[str, str]] = []
    real_from_file = torch.from_file

    def from_file(filename: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        real = _realpath(filename)
        if _outside(real):
            seen.append(("torch.from_file", real))
        return real_from_file(filename, *args, **kwargs)

    monkeypatch.setattr(torch, "from_file", from_file)
    _real_dir.cache_clear()
    _WATCH, _WATCH_ROOT, _WATCH_EXCEPT = seen, os.path.realpath(outside), os.path.realpath(prefix)
    try:
        yield seen
    finally:
        _WATCH = None
        monkeypatch.setattr(torch, "from_file", real_from_file)


def _every_entry_point(
    prefix: Path, capsys: pytest.CaptureFixture[str], robust_key: bool | None
) -> list[str]:
    """Run validate / inspect / load_memmap / the CLI; return every text they produced."""
    texts: list[str] = []
    report = validate(prefix, robust_key=robust_key)
    texts.append(json.dumps(report.to_json()))
    try:
        # repr, not to_json(): NodeInfo.to_json is quadratic in the tree depth (asdict of
        # every subtree at every level), which a 200-level tree makes take seconds.
        texts.append(repr(inspect(prefix, robust_key=robust_key)))
    except TdckptError as exc:
        texts.append(str(exc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = tdckpt.load_memmap(prefix, robust_key=robust_key, allow_pickle=False, mode="r")
        except TdckptError as exc:
            texts.append(str(exc))
        else:
            texts.append(repr(loaded))
    texts.extend(str(w.message) for w in caught)
    flag = {None: "auto", True: "true", False: "false"}[robust_key]
    for verb in ("validate", "inspect"):
        capsys.readouterr()
        code = cli.main([verb, str(prefix), "--robust-key", flag])
        out = capsys.readouterr()
        assert code in (0, 1)
        assert "Traceback" not in out.out + out.err
        if code == 1 and verb == "inspect":
            assert out.err.startswith("error: ") and out.err.count("\n") == 1
        texts.append(out.out + out.err)
    return texts


def _digest(root: Path) -> dict[str, str]:
    """``tree_digest``, but a special file (a FIFO) is recorded by type, never opened."""
    out: dict[str, str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in (*files, *(d for d in dirs if (Path(dirpath) / d).is_symlink())):
            path = Path(dirpath) / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                value = f"symlink:{os.readlink(path)}"
            elif stat.S_ISREG(mode) and path.lstat().st_size > 64 << 20:
                # The sparse 300 MB files: a write would change the size or the mtime.
                st = path.lstat()
                value = f"large:{st.st_size}:{st.st_mtime_ns}"
            elif stat.S_ISREG(mode):
                h = hashlib.sha256()
                with path.open("rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
                value = h.hexdigest()
            else:
                value = f"special:{stat.S_IFMT(mode)}"
            out[path.relative_to(root).as_posix()] = value
    return dict(sorted(out.items()))


def assert_contained(
    prefix: Path,
    outside: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *,
    robust_key: bool | None = None,
) -> Any:
    """Every entry point: no exception but TdckptError, nothing outside touched, nothing written."""
    root = Path(os.path.commonpath([prefix, outside]))
    before = _digest(root)
    with watch_outside(outside, prefix, monkeypatch) as seen:
        texts = _every_entry_point(prefix, capsys, robust_key)
    assert not seen, f"opened outside the prefix: {seen}"
    assert not any(SECRET in t for t in texts), "content from outside the prefix leaked"
    assert _digest(root) == before, "a hostile checkpoint made tdckpt write"
    return validate(prefix, robust_key=robust_key)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the prefix whose files are the targets of the attacks."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "passwd").write_bytes(SECRET_BYTES)
    meta = {
        "s": {"device": "cpu", "shape": [3, 2], "dtype": "torch.int64", "is_nested": False},
        "shape": [3],
        "device": "cpu",
        "_type": "<class 'tensordict._td.TensorDict'>",
        "_format_version": 1,
        "_class": "tensordict:TensorDict",
        "secret": SECRET,
    }
    (out / "meta.json").write_text(json.dumps(meta))
    (out / "s.memmap").write_bytes(SECRET_BYTES)
    return out


def _codes(report: Any) -> set[tuple[str, str]]:
    return {(p.code, p.path) for p in report.problems}


# -- symlinks -----------------------------------------------------------------------------


def test_symlinked_leaf_outside(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "flat")
    (prefix / "f32.memmap").unlink()
    (prefix / "f32.memmap").symlink_to(outside / "passwd")
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    assert ("unsafe-path", "f32.memmap") in _codes(report)
    assert any(p.key == ("f32",) for p in report.errors)


def test_symlinked_meta_json_outside(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "nested")
    (prefix / "sibling" / "meta.json").unlink()
    (prefix / "sibling" / "meta.json").symlink_to(outside / "meta.json")
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    assert ("unsafe-path", "sibling/meta.json") in _codes(report)


def test_symlinked_child_dir_outside(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "nested")
    _replace_dir_with_link(prefix / "sibling", outside)
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    assert ("unsafe-path", "sibling") in _codes(report)
    assert any(p.key == ("sibling",) for p in report.errors)


@pytest.mark.parametrize("target", [".", "..", "../.."])
def test_child_dir_symlink_cycle(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any, target: str
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "nested")
    _replace_dir_with_link(prefix / "lvl1" / "lvl2", target)
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    problems = [p for p in report.errors if p.path == "lvl1/lvl2" and p.code == "unsafe-path"]
    assert problems and ("cycle" in problems[0].message or "outside" in problems[0].message)


def _replace_dir_with_link(path: Path, target: Path | str) -> None:
    import shutil

    shutil.rmtree(path)
    path.symlink_to(target, target_is_directory=True)


def test_symlink_inside_the_tree_is_fine(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "flat")
    data = prefix / "data"
    data.mkdir()
    (prefix / "f32.memmap").rename(data / "f32.bin")
    (prefix / "f32.memmap").symlink_to("data/f32.bin")
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert report.ok


# -- legacy names that point out of the prefix ----------------------------------------------


def _legacy_escape_prefix(tmp_path: Path) -> Path:
    """A real tensordict checkpoint whose meta.json also names keys that escape it."""
    from tensordict import TensorDict

    prefix = tmp_path / "c" / "case" / "ckpt"
    TensorDict({"ok": torch.arange(3.0)}, batch_size=[3]).memmap(prefix, robust_key=False)
    leaf = {"device": "cpu", "shape": [3], "dtype": "torch.float32", "is_nested": False}
    meta = json.loads((prefix / "meta.json").read_bytes())
    meta = {
        "ok": meta["ok"],
        "../x": leaf,
        "/abs": leaf,
        "a/../../x": leaf,
        "..": {"type": "TensorDict"},
        "../outside": {"type": "TensorDict"},
        **{k: v for k, v in meta.items() if k != "ok"},
    }
    (prefix / "meta.json").write_text(json.dumps(meta))
    return prefix


def test_legacy_keys_escaping_the_prefix(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any
) -> None:
    prefix = _legacy_escape_prefix(tmp_path)
    case = prefix.parent
    # What a legacy writer would have left outside: a distinctive file for each escape.
    (case / "x.memmap").write_bytes(SECRET_BYTES)
    (case / "meta.json").write_text((outside / "meta.json").read_text())
    (case / "s.memmap").write_bytes(SECRET_BYTES)
    for robust_key in (False, None, True):
        report = assert_contained(prefix, case, capsys, monkeypatch, robust_key=robust_key)
        # Never followed: each escaping key is reported (lost, missing or unsafe) ...
        named = {p.key for p in report.problems}
        for key in ("../x", "/abs", "a/../../x", "..", "../outside"):
            assert (key,) in named, (robust_key, key, [str(p) for p in report.problems])
        # ... while the honest key is still there.
        leaves = {c.key for c in inspect(prefix, robust_key=robust_key).root.children}
        assert ("ok",) in leaves
        assert not (leaves & {("../x",), ("/abs",), ("..",), ("../outside",)})
    legacy = validate(prefix, robust_key=False)
    lost = {p.key for p in legacy.problems if p.code == "lost-key"}
    assert lost >= {("../x",), ("/abs",), ("..",), ("../outside",)}


# -- archives -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "evil", ["../evil.memmap", "nested/../../evil.memmap", "/abs/evil.memmap", "a/./b.memmap"]
)
def test_zip_slip_archive(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any, evil: str
) -> None:
    src = copy_case(tmp_path / "c", "0.15.3", "archive_stored")
    prefix = src.parent / "evil.tdz"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(prefix, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info.filename))
        zout.writestr(zipfile.ZipInfo(evil), SECRET_BYTES)
    names = zipfile.ZipFile(prefix).namelist()
    assert evil in names
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    assert report.errors[0].code == "unsafe-path"
    assert str(prefix) in report.errors[0].message
    assert not (src.parent.parent / "evil.memmap").exists()
    assert not (tmp_path / "evil.memmap").exists()


# -- metadata built to exhaust the reader ---------------------------------------------------


@pytest.mark.parametrize("where", ["meta.json", "lvl1/meta.json"])
def test_json_nested_100k_deep(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any, where: str
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "nested")
    depth = 100_000
    (prefix / where).write_text('{"shape": ' + "[" * depth + "]" * depth + "}")
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    [problem] = [p for p in report.errors if p.path == where]
    assert problem.code == "bad-json"
    assert "deep" in problem.message


@pytest.mark.parametrize(
    "shape", [[3, 2**63 - 1], [3, 2**62, 2**62], [3, 2**62], [2**63], [3, -(2**63)]]
)
def test_shapes_near_2_pow_63(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any, shape: list[int]
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "flat")
    meta = json.loads((prefix / "meta.json").read_bytes())
    meta["f32"]["shape"] = shape
    (prefix / "meta.json").write_text(json.dumps(meta))
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    assert any(p.key == ("f32",) for p in report.errors)


def test_batch_size_near_2_pow_63(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "zero_numel")
    meta = json.loads((prefix / "meta.json").read_bytes())
    meta["shape"] = [2**62, 2**62]  # zero-element leaves then claim no bytes at all
    (prefix / "meta.json").write_text(json.dumps(meta))
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok


def test_meta_json_of_300_mb(tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "nested")
    with open(prefix / "lvl1" / "meta.json", "r+b") as fh:
        fh.truncate(300 * 1024 * 1024)  # sparse: nothing is written
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    [problem] = [p for p in report.errors if p.path == "lvl1/meta.json"]
    assert problem.code == "bad-json" and "bytes" in problem.message


def test_root_meta_json_of_300_mb(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "flat")
    with open(prefix / "meta.json", "r+b") as fh:
        fh.truncate(300 * 1024 * 1024)
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    assert report.errors[0].path == "meta.json"


def test_directories_nested_too_deep(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any
) -> None:
    prefix = tmp_path / "c" / "case" / "ckpt"
    level = {
        "shape": [1],
        "device": "cpu",
        "_type": "<class 'tensordict._td.TensorDict'>",
        "_format_version": 1,
        "_class": "tensordict:TensorDict",
    }
    cur = prefix
    for _ in range(205):
        cur.mkdir(parents=True)
        (cur / "meta.json").write_text(json.dumps({"d": {"type": "TensorDict"}, **level}))
        cur = cur / "d"
    cur.mkdir()
    (cur / "meta.json").write_text(json.dumps(level))
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    assert any(p.code == "too-deep" for p in report.errors)


def test_many_keys_hostile_names(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any
) -> None:
    # Keys made of NUL, controls and separators: encoded names stay in the directory.
    prefix = copy_case(tmp_path / "c", "0.15.3", "flat")
    meta = json.loads((prefix / "meta.json").read_bytes())
    leaf = {"device": "cpu", "shape": [3], "dtype": "torch.uint8", "is_nested": False}
    for key in ["\0", "a\0/../../b", "\x01\x1f", "C:evil", "\\..\\x", "%2E%2E"]:
        meta[key] = leaf
    (prefix / "meta.json").write_text(json.dumps(meta))
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok  # their files are missing
    assert all(p.code == "missing-file" for p in report.errors)


def test_the_watch_sees_outside_access(tmp_path: Path, outside: Path, monkeypatch: Any) -> None:
    # The harness itself: an access outside the prefix is recorded, one inside is not.
    prefix = copy_case(tmp_path / "c", "0.15.3", "flat")
    with watch_outside(tmp_path, prefix, monkeypatch) as seen:
        (prefix / "meta.json").read_bytes()
        os.listdir(prefix)
        assert not seen
        (outside / "passwd").read_bytes()
        os.listdir(outside)
        torch.from_file(str(outside / "passwd"), shared=False, size=4, dtype=torch.uint8)
    assert [event for event, _ in seen] == ["open", "os.listdir", "torch.from_file"]


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Turn a blocking open() (a FIFO read) into an error instead of a hung test."""
    with alarm(seconds, TimeoutError("blocked: something opened a FIFO")):
        yield


@pytest.mark.parametrize("name", ["f32.memmap", "meta.json"])
def test_fifo_is_never_opened(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any, name: str
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "flat")
    (prefix / name).unlink()
    os.mkfifo(prefix / name)
    with _deadline(20):
        report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    assert any(name in p.message or p.path == name for p in report.errors)


@pytest.mark.parametrize(
    "sizes",
    [
        [[2**32, 2**32], [1, 1], [1, 1]],  # the int64 product wraps to 0
        [[2**62, 4], [1, 1], [1, 1]],
        [[2**63 - 1, 1], [1, 1], [1, 1]],
        [[-1, 2], [1, 1], [1, 1]],
    ],
)
def test_nested_tensor_size_table_overflow(
    tmp_path: Path, outside: Path, capsys: Any, monkeypatch: Any, sizes: list[list[int]]
) -> None:
    prefix = copy_case(tmp_path / "c", "0.15.3", "nested_tensor_strided")
    meta = json.loads((prefix / "meta.json").read_bytes())
    meta["nt"]["shape"] = [3, 2]
    (prefix / "meta.json").write_text(json.dumps(meta))
    (prefix / "nt.shape.memmap").write_bytes(torch.tensor(sizes).numpy().tobytes())
    report = assert_contained(prefix, outside, capsys, monkeypatch)
    assert not report.ok
    [problem] = report.errors
    assert (problem.code, problem.path, problem.key) == ("bad-shape", "nt.shape.memmap", ("nt",))
