"""`tdckpt.validate` and `tdckpt.inspect`: real checkpoints pass, every corruption is named.

The first half runs both functions over every 0.14.3 and 0.15.3 fixture case (directories and
``.tdz`` archives, copied into ``tmp_path``) and compares the inspection with the manifest's
``expected`` record. The second half damages a copy of a real tensordict-written checkpoint in
each way format-notes.md §4.3 lists, and checks that the report names the file and the key,
that ``report.ok`` is False for errors, that ``tdckpt validate`` exits 1, and that not one
byte of the prefix changed.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FixtureCase, case_id, copy_case, fixture_cases, tree_digest

from tdckpt import Inspection, NodeInfo, Problem, ValidationReport, cli, inspect, validate

CURRENT_CASES = fixture_cases(versions=["0.14.3", "0.15.3"])

#: Keys a writer could not store inside the prefix (format-notes §2.3): tdckpt reports them
#: as lost instead of restoring them.
WRITER_LOST: dict[str, set[str]] = {"odd_nested__robust_false": {".", ".."}}

_JSON_SCALARS = {
    "builtins.str",
    "builtins.int",
    "builtins.float",
    "builtins.bool",
    "builtins.NoneType",
}


def _is_json(value: Any) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False


def _pickled(rec: Mapping[str, Any]) -> bool:
    """Whether tensordict pickles this non-tensor value (format-notes §3.1)."""
    py_type = rec["py_type"]
    if py_type in _JSON_SCALARS:
        return False
    if py_type in ("builtins.list", "builtins.tuple", "builtins.dict"):
        return not _is_json(ast.literal_eval(rec["repr"]))
    return True


class _Compare:
    """Walk an inspection tree and a manifest ``expected`` record side by side."""

    def __init__(self, lost: set[str]) -> None:
        self.lost = lost
        self.diffs: list[str] = []
        self.pickles: list[tuple[str, ...]] = []
        self.nbytes = 0
        self.leaves = 0

    def fail(self, info: NodeInfo, msg: str) -> None:
        self.diffs.append(f"{'.'.join(info.key) or '<root>'}: {msg}")

    def node(self, info: NodeInfo, rec: Mapping[str, Any]) -> None:
        kind = rec.get("kind")
        if kind is None or kind in ("td", "tc"):
            self.collection(info, rec)
        elif kind == "tensor":
            self.leaf(info, rec)
            if info.class_name == "nested":
                self.fail(info, "a dense tensor reported as nested")
        elif kind == "nested_tensor":
            comps = rec["components"]
            self.leaf(
                info,
                {
                    **rec,
                    "shape": [len(comps), len(comps[0]["shape"])],
                    "nbytes": sum(c["nbytes"] for c in comps),
                },
            )
            if info.class_name != "nested":
                self.fail(info, "a nested tensor not reported as nested")
        elif kind == "non_tensor":
            if info.kind != "non-tensor":
                self.fail(info, f"kind {info.kind}, expected non-tensor")
            if _pickled(rec):
                self.pickles.append(info.key)
            if info.pickled != _pickled(rec):
                self.fail(info, f"pickled={info.pickled}, expected {_pickled(rec)}")
        else:  # pragma: no cover - the corpus has no other record kind
            raise AssertionError(f"unknown record {rec}")

    def leaf(self, info: NodeInfo, rec: Mapping[str, Any]) -> None:
        self.leaves += 1
        self.nbytes += rec["nbytes"]
        got = (info.kind, info.dtype, info.shape, info.nbytes)
        want = ("leaf", rec["dtype"], rec["shape"], rec["nbytes"])
        if got != want:
            self.fail(info, f"(kind, dtype, shape, nbytes) {got}, expected {want}")

    def collection(self, info: NodeInfo, rec: Mapping[str, Any]) -> None:
        type_ = rec["type"]
        if type_ == "LazyStackedTensorDict":
            if info.kind != "lazy-stack":
                self.fail(info, f"kind {info.kind}, expected lazy-stack")
            if len(info.children) != len(rec["items"]):
                self.fail(info, f"{len(info.children)} members, expected {len(rec['items'])}")
            for child, item in zip(info.children, rec["items"], strict=False):
                self.node(child, item)
            return
        if type_.startswith("tensorclass:"):
            if (info.kind, info.class_name) != ("tensorclass", type_.removeprefix("tensorclass:")):
                self.fail(info, f"{info.kind} {info.class_name}, expected {type_}")
        elif info.kind != "tensordict":
            self.fail(info, f"kind {info.kind}, expected tensordict")
        if info.batch_size != rec["batch_size"]:
            self.fail(info, f"batch size {info.batch_size}, expected {rec['batch_size']}")
        children = {c.key[-1]: c for c in info.children}
        wanted = {k for k in rec["entries"] if not (len(info.key) == 0 and k in self.lost)}
        if set(children) != wanted:
            self.fail(info, f"keys {sorted(children)}, expected {sorted(wanted)}")
        for name in sorted(wanted & set(children)):
            self.node(children[name], rec["entries"][name])


def _validate_cli(prefix: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(["validate", str(prefix), *extra])
    out = capsys.readouterr()
    return code, out.out + out.err


# -- every real checkpoint ----------------------------------------------------------------


@pytest.mark.parametrize("fc", CURRENT_CASES, ids=case_id)
def test_fixture_validates_and_inspects(fc: FixtureCase, tmp_path: Path) -> None:
    target = copy_case(tmp_path, fc)
    before = tree_digest(target.parent)

    report = validate(target)
    assert isinstance(report, ValidationReport)
    assert report.ok, [str(p) for p in report.errors]
    if fc.version == "0.15.3":
        assert report.generation == "G8"
    if fc.name.endswith("__robust_false"):
        assert report.key_encoding == "legacy"
    elif fc.version == "0.15.3" or fc.name.startswith("odd_"):
        assert report.key_encoding == "robust"
    else:
        # Names identical under both conventions: a 0.14.3 tree is detected as the oldest
        # generation consistent with it (G4), whose directory names were raw.
        assert report.key_encoding in ("robust", "legacy")

    info = inspect(target)
    assert isinstance(info, Inspection)
    assert info.storage == ("archive" if target.suffix == ".tdz" else "directory")
    assert info.generation == report.generation
    lost = WRITER_LOST.get(fc.name, set())
    cmp = _Compare(lost)
    cmp.node(info.root, fc.expected)
    assert not cmp.diffs, cmp.diffs
    assert info.total_bytes == cmp.nbytes
    assert info.leaf_count == cmp.leaves
    assert sorted(info.pickles) == sorted(cmp.pickles)
    for key in lost:
        assert any(repr(key) in text for text in info.lost), info.lost
    # validate reports each pickle (information, not an error) with its key and file.
    pickle_problems = [p for p in report.problems if p.code == "pickle"]
    assert sorted(p.key for p in pickle_problems) == sorted(cmp.pickles)
    for p in pickle_problems:
        assert p.severity == "info"
        assert p.path.endswith(("other.pickle", "pickle.pkl"))
    # The JSON form is JSON.
    json.dumps(info.to_json())
    json.dumps(report.to_json())

    assert tree_digest(target.parent) == before


def test_float8_is_valid(tmp_path: Path) -> None:
    # tensordict 0.15.3 writes float8 leaves it cannot read back; tdckpt reads them.
    target = copy_case(tmp_path, "0.15.3", "float8_dtypes")
    report = validate(target)
    assert report.ok and not report.problems
    dtypes = {c.key[-1]: c.dtype for c in inspect(target).root.children}
    assert dtypes == {"f8e4m3": "torch.float8_e4m3fn", "f8e5m2": "torch.float8_e5m2"}


# -- corruptions (format-notes §4.3) ------------------------------------------------------


def _edit_meta(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads(path.read_bytes())
    change(meta)
    path.write_text(json.dumps(meta))


def _refused(
    prefix: Path,
    capsys: pytest.CaptureFixture[str],
    *,
    code: str,
    path: str,
    key: tuple[str, ...] | None,
    robust_key: bool | None = None,
    mention: tuple[str, ...] = (),
) -> Problem:
    """Validate a damaged prefix: an error `code` naming `path` and `key`; nothing written."""
    case_dir = prefix.parent
    before = tree_digest(case_dir)
    report = validate(prefix, robust_key=robust_key)
    assert not report.ok
    assert not bool(report)
    matching = [p for p in report.errors if p.code == code]
    assert matching, [str(p) for p in report.problems]
    problem = matching[0]
    assert problem.path == path, str(problem)
    if key is not None:
        assert problem.key == key, str(problem)
    for text in mention:
        assert text in problem.message, problem.message
    flag = {None: "auto", True: "true", False: "false"}[robust_key]
    exit_code, output = _validate_cli(prefix, capsys, "--robust-key", flag)
    assert exit_code == 1
    assert code in output or problem.message[:40] in output
    assert "Traceback" not in output
    assert tree_digest(case_dir) == before, "validate modified the checkpoint"
    return problem


@pytest.fixture
def flat(tmp_path: Path) -> Path:
    return copy_case(tmp_path, "0.15.3", "flat")


@pytest.fixture
def nested(tmp_path: Path) -> Path:
    return copy_case(tmp_path, "0.15.3", "nested")


def test_truncated_leaf(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.truncate(flat / "f32.memmap", 10)
    _refused(
        flat, capsys, code="short-file", path="f32.memmap", key=("f32",), mention=("10 bytes", "24")
    )
    assert (flat / "f32.memmap").stat().st_size == 10  # never grown


def test_empty_leaf(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.truncate(flat / "i64.memmap", 0)
    _refused(flat, capsys, code="short-file", path="i64.memmap", key=("i64",), mention=("0 bytes",))


def test_missing_leaf_file(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (nested / "lvl1" / "x.memmap").unlink()
    _refused(nested, capsys, code="missing-file", path="lvl1/x.memmap", key=("lvl1", "x"))


def test_missing_deep_leaf_file(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (nested / "lvl1" / "lvl2" / "lvl3" / "z.memmap").unlink()
    _refused(
        nested,
        capsys,
        code="missing-file",
        path="lvl1/lvl2/lvl3/z.memmap",
        key=("lvl1", "lvl2", "lvl3", "z"),
    )


def test_unknown_dtype_string(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_meta(flat / "meta.json", lambda m: m["f32"].update(dtype="torch.float33"))
    _refused(
        flat,
        capsys,
        code="unknown-dtype",
        path="meta.json",
        key=("f32",),
        mention=("torch.float33",),
    )


def test_real_dtype_tensordict_cannot_read_is_valid(flat: Path) -> None:
    # Relabel the 3-byte bool leaf as float8 (same itemsize): a real torch dtype, so valid.
    _edit_meta(flat / "meta.json", lambda m: m["bool"].update(dtype="torch.float8_e4m3fn"))
    report = validate(flat)
    assert report.ok, [str(p) for p in report.problems]


def test_dtype_widened_makes_the_file_short(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_meta(flat / "meta.json", lambda m: m["f32"].update(dtype="torch.float64"))
    _refused(flat, capsys, code="short-file", path="f32.memmap", key=("f32",), mention=("48",))


def test_corrupted_nested_meta_json(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = nested / "lvl1" / "lvl2" / "meta.json"
    path.write_bytes(path.read_bytes()[:25])
    _refused(nested, capsys, code="bad-json", path="lvl1/lvl2/meta.json", key=("lvl1", "lvl2"))


def test_nested_meta_json_not_an_object(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (nested / "sibling" / "meta.json").write_text("[1, 2, 3]")
    _refused(nested, capsys, code="bad-json", path="sibling/meta.json", key=("sibling",))


def test_root_meta_json_missing(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (flat / "meta.json").unlink()
    problem = _refused(flat, capsys, code="not-found", path="", key=(), mention=("meta.json",))
    assert str(flat) in problem.message


def test_root_meta_json_truncated(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.truncate(flat / "meta.json", 40)
    _refused(flat, capsys, code="bad-json", path="meta.json", key=(), mention=("meta.json",))


def test_root_meta_json_invalid(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (flat / "meta.json").write_bytes(b"{'shape': [3]}")
    _refused(flat, capsys, code="bad-json", path="meta.json", key=(), mention=("not valid JSON",))


def test_root_meta_json_invalid_utf8(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (flat / "meta.json").write_bytes(b'{"shape": [3], "device": "\xff"}')
    _refused(flat, capsys, code="bad-json", path="meta.json", key=())


def test_missing_child_directory(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(nested / "sibling")
    _refused(nested, capsys, code="missing-child", path="sibling", key=("sibling",))


def test_missing_deep_child_directory(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(nested / "lvl1" / "lvl2" / "lvl3")
    _refused(
        nested, capsys, code="missing-child", path="lvl1/lvl2/lvl3", key=("lvl1", "lvl2", "lvl3")
    )


def test_leaf_shape_not_starting_with_batch(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # [3, 2] -> [2, 3]: the same bytes, but not a batch-[3] leaf.
    _edit_meta(flat / "meta.json", lambda m: m["f32"].update(shape=[2, 3]))
    _refused(
        flat,
        capsys,
        code="batch-mismatch",
        path="meta.json",
        key=("f32",),
        mention=("[2, 3]", "[3]"),
    )


def test_nested_leaf_shape_not_starting_with_batch(
    nested: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _edit_meta(nested / "lvl1" / "meta.json", lambda m: m["x"].update(shape=[6]))
    _refused(nested, capsys, code="batch-mismatch", path="lvl1/meta.json", key=("lvl1", "x"))


@pytest.mark.parametrize("where", ["meta.json", "lvl1/meta.json"])
def test_newer_format_version(nested: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    _edit_meta(nested / where, lambda m: m.update(_format_version=2))
    problem = _refused(nested, capsys, code="unsupported-format", path=where, key=None)
    assert "upgrade tdckpt" in problem.message.lower()
    assert "2" in problem.message


@pytest.mark.parametrize(
    ("where", "key"), [("meta.json", ()), ("lvl1/lvl2/meta.json", ("lvl1", "lvl2"))]
)
def test_unknown_class(
    nested: Path, capsys: pytest.CaptureFixture[str], where: str, key: tuple[str, ...]
) -> None:
    _edit_meta(nested / where, lambda m: m.update(_class="foo.bar:Baz"))
    _refused(nested, capsys, code="unknown-class", path=where, key=key, mention=("foo.bar:Baz",))


@pytest.mark.parametrize(
    ("shape", "code"),
    [
        ([3, 2**62, 2**62], "bad-shape"),
        ([3, 2**62], "bad-shape"),
        ([3, 2**63 - 1], "schema"),
        ([3, 2**63], "schema"),
        ([3, 2**64 + 5], "schema"),
        ([3, -2], "schema"),
        ([-3], "schema"),
    ],
)
def test_impossible_leaf_shapes(
    flat: Path, capsys: pytest.CaptureFixture[str], shape: list[int], code: str
) -> None:
    _edit_meta(flat / "meta.json", lambda m: m["f32"].update(shape=shape))
    _refused(flat, capsys, code=code, path="meta.json", key=("f32",))


@pytest.mark.parametrize("batch", [[2**63 - 1], [-1], [3, -1]])
def test_impossible_batch_size(
    flat: Path, capsys: pytest.CaptureFixture[str], batch: list[int]
) -> None:
    _edit_meta(flat / "meta.json", lambda m: m.update(shape=batch))
    _refused(flat, capsys, code="schema", path="meta.json", key=(), mention=("shape",))


def _write_legacy(prefix: Path, keys: dict[str, float]) -> None:
    from tensordict import TensorDict

    td = TensorDict({k: torch.full((3,), v) for k, v in keys.items()}, batch_size=[3])
    td.memmap(prefix, robust_key=False)


def test_two_keys_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A legacy directory holding keys "a b" and "a%20b": under robust names "a b" reads
    # a%20b.memmap, which is also the legacy file of "a%20b" (format-notes §2.3).
    prefix = tmp_path / "case" / "ckpt"
    _write_legacy(prefix, {"a b": 1.0, "a%20b": 2.0})
    assert sorted(os.listdir(prefix)) == ["a b.memmap", "a%20b.memmap", "meta.json"]
    problem = _refused(
        prefix, capsys, code="name-collision", path="a%20b.memmap", key=None, robust_key=True
    )
    assert problem.key in (("a b",), ("a%20b",))
    assert "'a b'" in problem.message and "'a%20b'" in problem.message

    # robust_key=None decides per directory: the legacy convention, each key its own file.
    before = tree_digest(prefix)
    report = validate(prefix)
    assert report.ok and report.key_encoding == "legacy"
    leaves = {c.key: c.path for c in inspect(prefix).root.children}
    assert leaves == {("a b",): "a b.memmap", ("a%20b",): "a%20b.memmap"}
    assert _validate_cli(prefix, capsys)[0] == 0
    assert tree_digest(prefix) == before


def test_ambiguous_encoding_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tensordict import TensorDict

    prefix = tmp_path / "case" / "ckpt"
    TensorDict({"a b": torch.zeros(3)}, batch_size=[3]).memmap(prefix)  # a%20b.memmap
    _write_legacy(tmp_path / "legacy", {"a b": 1.0})
    shutil.copy(tmp_path / "legacy" / "a b.memmap", prefix / "a b.memmap")
    problem = _refused(
        prefix,
        capsys,
        code="ambiguous-key-encoding",
        path="a%20b.memmap",
        key=None,
        mention=("'a b'", "a%20b.memmap", "a b.memmap", "robust_key"),
    )
    # The ambiguity is the only error: the key's files are not also called missing.
    assert [p.code for p in validate(prefix).errors] == [problem.code]
    # An explicit convention resolves it.
    assert validate(prefix, robust_key=True).ok
    assert validate(prefix, robust_key=False).ok


def test_stray_file_is_a_warning(flat: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (flat / "junk.bin").write_bytes(b"x" * 10)
    (flat / "old.memmap").write_bytes(b"\0" * 8)
    before = tree_digest(flat)
    report = validate(flat)
    assert report.ok
    strays = sorted(p.path for p in report.warnings if p.code == "stray-file")
    assert strays == ["junk.bin", "old.memmap"]
    code, output = _validate_cli(flat, capsys)
    assert code == 0 and "junk.bin" in output and "warning" in output
    assert tree_digest(flat) == before


def test_stray_directory_is_a_warning(nested: Path) -> None:
    (nested / "orphan").mkdir()
    (nested / "orphan" / "meta.json").write_text("{}")
    report = validate(nested)
    assert report.ok
    assert [p.path for p in report.warnings if p.code == "stray-directory"] == ["orphan"]


def test_pickled_sidecars_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = copy_case(tmp_path, "0.15.3", "non_tensor_pickle")
    report = validate(target)
    assert report.ok
    pickles = {p.key: p.path for p in report.problems if p.code == "pickle"}
    assert pickles == {
        ("date",): "date/other.pickle",
        ("point",): "point/other.pickle",
        ("bytes",): "bytes/other.pickle",
        ("set",): "set/other.pickle",
    }
    assert all("allow_pickle" in p.message for p in report.problems if p.code == "pickle")
    code, output = _validate_cli(target, capsys)
    assert code == 0 and "date/other.pickle" in output


def test_missing_pickle_sidecar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = copy_case(tmp_path, "0.15.3", "non_tensor_pickle")
    (target / "point" / "other.pickle").unlink()
    _refused(target, capsys, code="missing-file", path="point/other.pickle", key=("point",))


def test_every_problem_at_once(nested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.truncate(nested / "top.memmap", 1)
    (nested / "lvl1" / "x.memmap").unlink()
    shutil.rmtree(nested / "sibling")
    _edit_meta(
        nested / "lvl1" / "lvl2" / "meta.json", lambda m: m["y"].update(dtype="torch.float33")
    )
    report = validate(nested)
    found = {(p.code, p.key) for p in report.errors}
    assert found >= {
        ("short-file", ("top",)),
        ("missing-file", ("lvl1", "x")),
        ("missing-child", ("sibling",)),
        ("unknown-dtype", ("lvl1", "lvl2", "y")),
    }
    capsys.readouterr()
    code = cli.main(["validate", str(nested), "--json"])
    out = capsys.readouterr()
    assert code == 1
    data = json.loads(out.out)  # the report on stdout; one `error:` line on stderr
    assert out.err.startswith("error: ") and out.err.count("\n") == 1
    assert data["ok"] is False
    assert len([p for p in data["problems"] if p["severity"] == "error"]) == len(report.errors)


def test_corrupted_archive_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = copy_case(tmp_path, "0.15.3", "archive_stored")
    data = bytearray(target.read_bytes())
    target.write_bytes(bytes(data[: len(data) // 2]))  # the central directory is gone
    before = tree_digest(target)
    report = validate(target)
    assert not report.ok
    assert str(target) in report.errors[0].message
    assert _validate_cli(target, capsys)[0] == 1
    assert tree_digest(target) == before


def test_inspect_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    from tdckpt.errors import CheckpointNotFoundError

    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"meta\.json"):
        inspect(tmp_path / "empty")
    with pytest.raises(CheckpointNotFoundError):
        inspect(tmp_path / "absent")
    report = validate(tmp_path / "absent")
    assert not report.ok and report.errors[0].code == "not-found"


@pytest.mark.parametrize("device", ["None", "cuda:0", "meta"])
def test_lazy_stack_members_on_different_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], device: str
) -> None:
    # tensordict cannot stack them ("devices differ"): refused before any restore.
    target = copy_case(tmp_path, "0.15.3", "lazy_stack")
    _edit_meta(target / "1" / "meta.json", lambda m: m.update(device=device))
    _refused(target, capsys, code="stack-mismatch", path="", key=(), mention=("devices",))
