"""Consolidated files (``td.consolidate(filename=...)``): read, validate, restore, refuse.

Every well-formed file here is written by the installed tensordict (0.15.3) itself; hostile
files are real ones with their metadata or footer rewritten. A refused file leaves the
target exactly as it was, and the file is never written.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from _tdversion import TD_VERSION
from fixture_types import FixtureTC
from packaging.version import Version
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict
from tensordict.utils import _STR_DTYPE_TO_DTYPE

import tdckpt
from tdckpt._read.consolidated import ConsolidatedStorage, open_consolidated
from tdckpt._read.nodes import DTYPES
from tdckpt._read.opener import open_storage
from tdckpt._read.storage import MAX_JSON_BYTES
from tdckpt.errors import MetadataError, TdckptError, UnsupportedFormatError, ValidationError


# -- helpers ---------------------------------------------------------------------------
def write(td: Any, path: Path) -> Path:
    td.consolidate(filename=path)
    return path


def split(path: Path) -> tuple[bytes, dict[str, Any]]:
    """The leaf bytes and the parsed metadata of a consolidated file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<q", raw[-8:])
    return raw[: -8 - n], json.loads(raw[-8 - n : -8])


def join(path: Path, data: bytes, meta: Any, *, length: int | None = None) -> Path:
    """Write ``data`` + JSON ``meta`` + footer (its true length unless ``length``)."""
    blob = json.dumps(meta).encode() if not isinstance(meta, bytes) else meta
    path.write_bytes(data + blob + struct.pack("<q", len(blob) if length is None else length))
    return path


def keys(td: Any) -> list[str]:
    return sorted(str(k) for k in td.keys(True, True))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(td: Any) -> dict[Any, Any]:
    return {k: v.clone() for k, v in td.items(True, True)} | {"_keys": keys(td)}


def same(td: Any, shot: dict[Any, Any]) -> bool:
    if keys(td) != shot["_keys"]:
        return False
    return all(torch.equal(td.get(k), v) for k, v in shot.items() if k != "_keys")


def nested_td() -> TensorDict:
    return TensorDict(
        {
            "f32": torch.arange(6, dtype=torch.float32).reshape(3, 2),
            "i64": torch.tensor([1, -2, 3]),
            "with space": torch.tensor([5, 6, 7], dtype=torch.int16),
            "a.b%c": torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64),
            "empty": torch.zeros(3, 0),
            "nested": {
                "b": torch.tensor([True, False, True]),
                "deep space": {"u8": torch.tensor([7, 8, 9], dtype=torch.uint8)},
            },
        },
        batch_size=[3],
    )


def assert_equal_td(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    assert ours.batch_size == theirs.batch_size
    assert keys(ours) == keys(theirs)
    for key in theirs.keys(True, True):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True
        else:
            assert a == b, key


# -- reading what tensordict writes ------------------------------------------------------
def test_nested_tensordict_round_trips_like_from_consolidated(tmp_path: Path) -> None:
    path = write(nested_td(), tmp_path / "td.bin")
    before = digest(path)
    ours = tdckpt.load_memmap(path, allow_pickle=False)
    theirs = TensorDict.from_consolidated(path)
    assert_equal_td(ours, theirs)
    assert digest(path) == before


def test_inspect_and_validate_read_the_file(tmp_path: Path) -> None:
    path = write(nested_td(), tmp_path / "td.bin")
    info = tdckpt.inspect(path)
    assert info.storage == "consolidated"
    assert info.leaf_count == 7
    leaves = {c.key: c for c in info.root.children if c.kind == "leaf"}
    assert leaves[("with space",)].dtype == "torch.int16"
    assert leaves[("f32",)].shape == [3, 2]
    report = tdckpt.validate(path)
    assert report.ok, report.problems


def test_every_dtype(tmp_path: Path) -> None:
    """Every dtype tensordict writes and torch can build a tensor of, one leaf each."""
    values: dict[str, torch.Tensor] = {}
    for name, dtype in DTYPES.items():
        if dtype is torch.complex32 or name not in _STR_DTYPE_TO_DTYPE:
            continue  # torch warns that complex32 is experimental; tensordict lacks the rest
        try:
            values[name.replace(".", "_")] = (
                torch.arange(5).to(dtype)
                if dtype != torch.bool
                else (torch.tensor([True, False, True, True, False]))
            )
        except (RuntimeError, TypeError):
            try:
                values[name.replace(".", "_")] = torch.ones(5, dtype=torch.uint8).view(dtype)
            except (RuntimeError, TypeError):
                continue
    assert len(values) >= 15
    # Widest first: tensordict pads leaves to 8 bytes and cannot itself write a 16-byte
    # dtype at an offset that is not a multiple of 16.
    values = dict(sorted(values.items(), key=lambda kv: -kv[1].dtype.itemsize))
    path = write(TensorDict(values, batch_size=[5]), tmp_path / "dtypes.bin")
    ours = tdckpt.load_memmap(path, allow_pickle=False)
    for key, value in values.items():
        got = ours[key]
        assert got.dtype == value.dtype, key
        assert torch.equal(got.view(torch.uint8), value.contiguous().view(torch.uint8)), key


def test_non_tensor_data_and_stacks(tmp_path: Path) -> None:
    td = TensorDict(
        {
            "x": torch.ones(2),
            "text": NonTensorData("hello", batch_size=[2]),
            "cfg": NonTensorData({"lr": 0.1, "layers": [1, 2]}, batch_size=[2]),
            "words": NonTensorStack("a", "b"),
        },
        batch_size=[2],
    )
    path = write(td, tmp_path / "nt.bin")
    ours = tdckpt.load_memmap(path, allow_pickle=False)
    assert ours["text"] == "hello"
    assert ours["cfg"] == {"lr": 0.1, "layers": [1, 2]}
    assert ours["words"] == ["a", "b"]
    assert torch.equal(ours["x"], torch.ones(2))


@pytest.mark.skipif(
    TD_VERSION is not None and Version("0.15") > TD_VERSION,
    reason="tensordict < 0.15 cannot consolidate a tensorclass",
)
def test_tensorclass(tmp_path: Path) -> None:
    tc = FixtureTC(
        obs=torch.arange(4.0).reshape(2, 2),
        reward=torch.tensor([1.0, -1.0]),
        label="ok",
        extra={"k": 1},
        batch_size=[2],
    )
    outer = TensorDict({"tc": tc, "y": torch.zeros(2)}, batch_size=[2])
    path = write(outer, tmp_path / "tc.bin")
    ours = tdckpt.load_memmap(path, allow_pickle=False)
    assert isinstance(ours["tc"], FixtureTC)
    assert torch.equal(ours["tc"].obs, tc.obs)
    assert ours["tc"].label == "ok"
    assert ours["tc"].extra == {"k": 1}
    top = write(tc, tmp_path / "top.bin")
    again = tdckpt.load_memmap(top, allow_pickle=False)
    # tensordict writes a top-level tensorclass as its TensorDict, and reads that back.
    assert type(again) is type(TensorDict.from_consolidated(top))
    assert torch.equal(again["reward"], tc.reward)


def test_lazy_stack(tmp_path: Path) -> None:
    members = [
        TensorDict(a=torch.ones(3), n={"x": torch.full((1,), 2.0)}),
        TensorDict(a=torch.zeros(3), n={"x": torch.full((1,), 3.0)}),
    ]
    td = TensorDict(ls=LazyStackedTensorDict(*members, stack_dim=0), batch_size=[2])
    path = write(td, tmp_path / "lazy.bin")
    ours = tdckpt.load_memmap(path, allow_pickle=False)
    assert isinstance(ours["ls"], LazyStackedTensorDict)
    assert torch.equal(ours["ls"][1]["n", "x"], torch.full((1,), 3.0))
    assert torch.equal(ours["ls", "a"], torch.stack([torch.ones(3), torch.zeros(3)]))


def test_leaves_are_views_of_one_mapping(tmp_path: Path) -> None:
    path = write(nested_td(), tmp_path / "td.bin")
    ours = tdckpt.load_memmap(path, allow_pickle=False)
    ptrs = {v.untyped_storage().data_ptr() for v in ours.values(True, True) if v.numel()}
    assert len(ptrs) == 1


def test_load_memmap__in_place(tmp_path: Path) -> None:
    path = write(nested_td(), tmp_path / "td.bin")
    target = nested_td().apply(torch.zeros_like)
    target["stale"] = torch.zeros(3)
    nested = target["nested"]
    out = tdckpt.load_memmap_(target, path, allow_pickle=False)
    assert out is target and target["nested"] is nested
    assert "stale" not in target
    assert_equal_td(target, TensorDict.from_consolidated(path))


@pytest.mark.parametrize("mode", [None, "r"])
def test_writes_never_reach_the_file(tmp_path: Path, mode: str | None) -> None:
    path = write(nested_td(), tmp_path / "td.bin")
    before = digest(path)
    ours = tdckpt.load_memmap(path, allow_pickle=False, mode=mode)
    ours["f32"].add_(100)
    assert digest(path) == before


def test_mode_r_plus_writes_through(tmp_path: Path) -> None:
    path = write(nested_td(), tmp_path / "td.bin")
    ours = tdckpt.load_memmap(path, allow_pickle=False, mode="r+")
    ours["i64"].fill_(42)
    del ours
    assert torch.equal(TensorDict.from_consolidated(path)["i64"], torch.full((3,), 42))


def test_a_zip_is_still_an_archive(tmp_path: Path) -> None:
    nested_td().memmap(tmp_path / "dir")
    from tensordict import pack_memmap

    pack_memmap(tmp_path / "dir", tmp_path / "a.tdz")
    assert open_consolidated(tmp_path / "a.tdz") is None
    with open_storage(tmp_path / "a.tdz") as storage:
        assert storage.kind == "archive"


# -- hostile files, refused before anything is touched ----------------------------------
def _refused(path: Path, match: str, error: type[Exception] = MetadataError) -> None:
    target = nested_td()
    shot = snapshot(target)
    before = digest(path)
    with pytest.raises(error, match=match):
        tdckpt.load_memmap_(target, path, allow_pickle=False)
    assert same(target, shot)
    with pytest.raises(error, match=match):
        tdckpt.load_memmap(path, allow_pickle=False)
    assert digest(path) == before
    report = tdckpt.validate(path)
    assert not report.ok


def _rewrite(tmp_path: Path, edit: Any) -> Path:
    path = write(nested_td(), tmp_path / "good.bin")
    data, meta = split(path)
    edit(meta)
    return join(tmp_path / "bad.bin", data, meta)


def test_offset_past_the_end(tmp_path: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        leaf = meta["leaves"]["i64"]
        leaf[2], leaf[3] = 10**9, 10**9 + 24

    _refused(_rewrite(tmp_path, edit), r"'i64'.*not inside the \d+ bytes")


def test_overlapping_leaves(tmp_path: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        start = meta["leaves"]["f32"][2]
        meta["leaves"]["i64"][2:4] = [start, start + 24]

    _refused(_rewrite(tmp_path, edit), "overlap")


def test_size_disagrees_with_shape(tmp_path: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        meta["leaves"]["f32"][1] = [300, 2]

    _refused(_rewrite(tmp_path, edit), r"'f32'.*do not hold")


def test_unknown_dtype_and_bad_shape(tmp_path: Path) -> None:
    def dtype(meta: dict[str, Any]) -> None:
        meta["nested"]["leaves"]["b"][0] = "torch.evil"

    _refused(_rewrite(tmp_path, dtype), "'nested/b'.*not a torch dtype")

    def shape(meta: dict[str, Any]) -> None:
        meta["leaves"]["i64"][1] = [-3]

    _refused(_rewrite(tmp_path, shape), "holds -3")


def test_a_zero_element_shape_whose_strides_overflow_is_refused(tmp_path: Path) -> None:
    """[0, 2**62, 2**62] holds no byte, but torch cannot build it ("Stride calculation
    overflowed"): validate said ok and the restore failed with "report it as a tdckpt bug".
    Refused by both, naming the key, as for a directory checkpoint."""

    def shape(meta: dict[str, Any]) -> None:
        leaf = meta["leaves"]["i64"]
        leaf[1], leaf[3], leaf[4] = [0, 2**62, 2**62], leaf[2], 0

    _refused(_rewrite(tmp_path, shape), r"'i64'.*past the 2\*\*63 - 1 a tensor's strides")


def test_misaligned_leaf(tmp_path: Path) -> None:
    path = write(TensorDict(a=torch.ones(2, dtype=torch.float64)), tmp_path / "one.bin")
    data, meta = split(path)
    meta["leaves"]["a"] = ["torch.float64", [2], 4, 20, 0]
    _refused_plain(join(tmp_path / "bad.bin", data + bytes(8), meta), "not aligned")


def _refused_plain(path: Path, match: str) -> None:
    before = digest(path)
    with pytest.raises(MetadataError, match=match):
        tdckpt.load_memmap(path, allow_pickle=False)
    assert digest(path) == before


def test_metadata_bomb_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "bomb.bin"
    # A footer that declares more metadata than tdckpt reads: refused before reading it.
    with open(path, "wb") as fh:
        fh.truncate(MAX_JSON_BYTES + 64)
        fh.seek(MAX_JSON_BYTES + 64 - 8 - MAX_JSON_BYTES - 1)
        fh.write(b"{")
        fh.seek(MAX_JSON_BYTES + 64 - 8)
        fh.write(struct.pack("<q", MAX_JSON_BYTES + 1))
    with pytest.raises(MetadataError, match="more than the"):
        tdckpt.load_memmap(path, allow_pickle=False)


def test_nesting_and_container_bombs(tmp_path: Path) -> None:
    deep: dict[str, Any] = {"cls": "TensorDict", "non_tensors": {}, "leaves": {}}
    level = deep
    for _ in range(300):
        child = {"cls": "TensorDict", "non_tensors": {}, "leaves": {}, "cls_metadata": {}}
        level["cls_metadata"] = {"batch_size": [], "device": None, "names": [], "is_locked": False}
        level["c"] = child
        level = child
    level["cls_metadata"] = {"batch_size": [], "device": None, "names": [], "is_locked": False}
    _refused_plain(join(tmp_path / "deep.bin", b"", deep), "nest more than")
    many = b"[" + b"[]," * 2_100_000 + b"[]]"
    blob = b'{"x": ' + many + b"}"
    _refused_plain(join(tmp_path / "many.bin", b"", blob), "arrays and objects")


def test_truncated_file(tmp_path: Path) -> None:
    path = write(nested_td(), tmp_path / "td.bin")
    raw = path.read_bytes()
    # Cut inside the leaves: the footer is gone, nothing readable is left.
    cut = tmp_path / "cut.bin"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TdckptError):
        tdckpt.load_memmap(cut, allow_pickle=False)
    # Leaves cut out with the metadata kept: every offset is now past the end.
    data, meta = split(path)
    _refused(join(tmp_path / "short.bin", data[:8], meta), "not inside")


def test_truncated_after_validation_is_refused(tmp_path: Path) -> None:
    path = write(nested_td(), tmp_path / "td.bin")
    storage = open_storage(path)
    assert isinstance(storage, ConsolidatedStorage)
    with storage:
        with open(path, "r+b") as fh:
            fh.truncate(16)
        with pytest.raises(MetadataError, match="changed size since it was checked"):
            storage.map("f32.memmap", torch.float32, 6, mode="r")


def test_lost_class_name_of_old_releases(tmp_path: Path) -> None:
    """tensordict 0.5 - 0.7 recorded a tensorclass by its bare name: nobody can load it."""

    def edit(meta: dict[str, Any]) -> None:
        meta["nested"]["cls"] = "FixtureTC"

    _refused(_rewrite(tmp_path, edit), "bare name", UnsupportedFormatError)


def test_nested_jagged_tensors_are_refused_by_name(tmp_path: Path) -> None:
    njt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    path = write(TensorDict(j=njt, batch_size=[2]), tmp_path / "njt.bin")
    _refused_plain_error(path, "nested jagged", UnsupportedFormatError)


def _refused_plain_error(path: Path, match: str, error: type[Exception]) -> None:
    with pytest.raises(error, match=match):
        tdckpt.load_memmap(path, allow_pickle=False)


def test_older_non_tensor_entries(tmp_path: Path) -> None:
    """tensordict 0.5 - 0.7 wrote a non-tensor entry as [data, batch_size] (no device)."""
    td = TensorDict(x=torch.ones(2), s=NonTensorData("v", batch_size=[2]), batch_size=[2])
    path = write(td, tmp_path / "td.bin")
    data, meta = split(path)
    meta["non_tensors"]["s"] = meta["non_tensors"]["s"][:2]
    old = join(tmp_path / "old.bin", data, meta)
    with pytest.raises(ValueError):  # tensordict 0.15.3 itself no longer reads this form
        TensorDict.from_consolidated(old)
    ours = tdckpt.load_memmap(old, allow_pickle=False)
    assert ours["s"] == "v"


def test_not_a_level(tmp_path: Path) -> None:
    _refused_plain(join(tmp_path / "list.bin", b"", {"cls": "TensorDict"}), "no 'non_tensors'")
    bad = {"cls": 3, "non_tensors": {}, "leaves": {}, "cls_metadata": {}}
    _refused_plain(join(tmp_path / "cls.bin", b"", bad), "expected a class name")


def test_error_is_a_validation_error_for_validate(tmp_path: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        meta["leaves"]["i64"][3] += 8

    path = _rewrite(tmp_path, edit)
    report = tdckpt.validate(path)
    assert not report.ok
    assert any("i64" in p.message for p in report.problems)
    with pytest.raises((MetadataError, ValidationError)):
        tdckpt.load_memmap(path, allow_pickle=False)


def test_the_file_is_opened_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything - footer, metadata, mapping - is read from one descriptor."""
    path = write(nested_td(), tmp_path / "td.bin")
    opened: list[str] = []
    real_open = os.open

    def counting(p: Any, *args: Any, **kwargs: Any) -> int:
        if os.fspath(p) == os.fspath(path):
            opened.append(os.fspath(p))
        return real_open(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    tdckpt.load_memmap(path, allow_pickle=False)
    assert len(opened) == 1


# -- a file written by a released tensordict 0.14.3 wheel ---------------------------------
FIXTURE_014 = Path(__file__).parent / "fixtures" / "consolidated" / "tensordict-0.14.3-nested.bin"


def test_a_file_written_by_tensordict_0_14_3(tmp_path: Path) -> None:
    path = tmp_path / "td.bin"
    path.write_bytes(FIXTURE_014.read_bytes())
    ours = tdckpt.load_memmap(path, allow_pickle=False)
    theirs = TensorDict.from_consolidated(path)
    assert keys(ours) == keys(theirs)
    assert torch.equal(ours["f32"], torch.arange(6.0).reshape(3, 2))
    assert ours["with space"].dtype == torch.float64
    assert torch.equal(ours["nested", "deep", "u8"], torch.tensor([7, 8, 9], dtype=torch.uint8))
    assert ours["text"] == "hello"
    assert isinstance(ours["ls"], LazyStackedTensorDict)
    assert torch.equal(ours["ls", "a"][:, 0], torch.tensor([0.0, 1.0, 2.0]))
    target = ours.apply(torch.zeros_like)
    tdckpt.load_memmap_(target, path, allow_pickle=False)
    assert torch.equal(target["f32"], ours["f32"])
    assert tdckpt.validate(path).ok


# -- the nodes built while checking the metadata are validation's own --------------------
def _validated_by_the_general_read(path: Path) -> tuple[Any, list[Any]]:
    from tdckpt._read.migrate import migrate_tree
    from tdckpt._read.names import normalize_names
    from tdckpt._read.tree import read_tree
    from tdckpt._read.validate import build_nodes

    with open_storage(path) as storage:
        tree = read_tree(storage)
        migrated = migrate_tree(tree, storage=storage)
        names = normalize_names(migrated.tree, robust_key=True, storage=storage)
        return build_nodes(names.tree, storage)


SIMPLE = {
    "flat": lambda: TensorDict({f"k{i}": torch.randn(4) for i in range(50)}, batch_size=[4]),
    "nested": nested_td,
    "odd keys": lambda: TensorDict(
        {"": torch.ones(1), ".": torch.ones(1), "a/b": {"é ü": torch.zeros(1, 2)}}, batch_size=[1]
    ),
    "named": lambda: TensorDict(a=torch.ones(2, 3), batch_size=[2], names=["rows"]),
    "empty": lambda: TensorDict(),
}


@pytest.mark.parametrize("case", SIMPLE, ids=str)
def test_prebuilt_nodes_are_what_validation_builds(tmp_path: Path, case: str) -> None:
    path = write(SIMPLE[case](), tmp_path / "td.bin")
    with open_storage(path) as storage:
        prebuilt = storage.validated_root()
    assert prebuilt is not None
    root, problems = _validated_by_the_general_read(path)
    assert problems == []
    assert prebuilt == root


def test_anything_else_is_validated_by_the_general_read(tmp_path: Path) -> None:
    def batch_mismatch(meta: dict[str, Any]) -> None:
        meta["cls_metadata"]["batch_size"] = [4]

    path = _rewrite(tmp_path, batch_mismatch)
    with open_storage(path) as storage:
        assert storage.validated_root() is None
    report = tdckpt.validate(path)
    assert {p.code for p in report.problems} == {"batch-mismatch"}
    target = nested_td()
    shot = snapshot(target)
    with pytest.raises(ValidationError, match="does not start with the batch size"):
        tdckpt.load_memmap_(target, path, allow_pickle=False)
    assert same(target, shot)
    td = TensorDict(x=torch.ones(2), s=NonTensorData("v", batch_size=[2]), batch_size=[2])
    with open_storage(write(td, tmp_path / "nt.bin")) as storage:
        assert storage.validated_root() is None  # non-tensor data: the general read


@pytest.mark.parametrize("robust_key", [True, False, None])
def test_the_key_encoding_argument_does_not_apply(tmp_path: Path, robust_key: Any) -> None:
    """Keys are recorded verbatim: robust_key=False or None must not look for raw names."""
    td = TensorDict({"a b": torch.ones(2), "n m": {"x%y": torch.zeros(1)}})
    td["n m", "s"] = NonTensorData("v")  # the general read, not only the prebuilt nodes
    path = write(td, tmp_path / "td.bin")
    ours = tdckpt.load_memmap(path, robust_key=robust_key, allow_pickle=False)
    assert torch.equal(ours["a b"], torch.ones(2))
    assert ours["n m", "s"] == "v"


def test_values_json_gives_other_types_are_refused(tmp_path: Path) -> None:
    """Booleans and floats where tensordict writes ints (JSON has no int type of its own)."""

    def bool_shape(meta: dict[str, Any]) -> None:
        meta["leaves"]["i64"][1] = [True, True, True]

    _refused(_rewrite(tmp_path, bool_shape), "holds True")

    def float_start(meta: dict[str, Any]) -> None:
        meta["leaves"]["i64"][2] = float(meta["leaves"]["i64"][2])

    _refused(_rewrite(tmp_path, float_start), "start offset .* is not an int")


def test_overlap_across_levels(tmp_path: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        start = meta["leaves"]["f32"][2]
        meta["nested"]["deep space"]["leaves"]["u8"][2:4] = [start, start + 8]

    _refused(_rewrite(tmp_path, edit), r"'nested/deep space/u8'.*overlap.*'f32'|overlap")


def test_truncated_between_validation_and_mapping_leaves_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is cut after its metadata was checked and before it is mapped: refused, and
    the target is exactly as it was."""
    path = write(nested_td(), tmp_path / "td.bin")
    real = ConsolidatedStorage._mapping

    def cut_first(self: ConsolidatedStorage, *, shared: bool) -> torch.Tensor:
        with open(path, "r+b") as fh:
            fh.truncate(16)
        return real(self, shared=shared)

    monkeypatch.setattr(ConsolidatedStorage, "_mapping", cut_first)
    target = nested_td().apply(torch.zeros_like)
    shot = snapshot(target)
    with pytest.raises(MetadataError, match="changed size since it was checked"):
        tdckpt.load_memmap_(target, path, allow_pickle=False)
    assert same(target, shot)


def test_without_tensordict_a_consolidated_file_loads_as_plain_dicts(tmp_path: Path) -> None:
    """Reading needs no tensordict (design.md, Contracts): nested dicts of mapped tensors."""
    import subprocess
    import sys

    path = tmp_path / "td.bin"
    path.write_bytes(FIXTURE_014.read_bytes())
    code = (
        "import sys; sys.modules['tensordict'] = None\n"
        "import json, tdckpt\n"
        f"r = tdckpt.load_memmap({str(path)!r}, allow_pickle=False)\n"
        "print(json.dumps({'keys': sorted(r), 'f32': r['f32'].tolist(),"
        " 'u8': r['nested']['deep']['u8'].tolist()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["keys"] == ["f32", "i16", "ls", "nested", "text", "with space"]
    assert result["f32"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert result["u8"] == [7, 8, 9]


def test_the_parse_is_freed_by_reference_counting(tmp_path: Path) -> None:
    """The parser and its leaf checker referred to each other (a bound method), so a
    10,000-leaf parse - every node - stayed alive until the collector ran, which then ran
    inside the next call (5 ms of a 25 ms restore, seen in benchmarks/run.py restore)."""
    import gc
    import weakref

    from tdckpt._read.consolidated_parse import _Parser

    path = write(nested_td(), tmp_path / "good.bin")
    _, meta = split(path)
    enabled = gc.isenabled()
    gc.disable()
    try:
        parser = _Parser(10**6, str(path))
        parser.parse(meta)
        gone = weakref.ref(parser)
        del parser
        assert gone() is None  # freed at once, no collection needed
    finally:
        if enabled:
            gc.enable()
