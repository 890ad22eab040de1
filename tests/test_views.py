"""Sub-tensordicts and lazy views: read, validated, restored as tensordict 0.15.3 restores them.

Checkpoints are written by tensordict 0.15.3 itself (``td._get_sub_tensordict(idx)`` writes a
``_SubTensorDict`` directory; the lazy-view classes still write a view directory when built
directly), or crafted in the 0.3 (G2) layout of format-notes §G2. Every load is compared
with ``TensorDict.load_memmap`` on the same directory: class, batch size, keys and values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _tdversion import WRITES_FORMAT_VERSION
from conftest import tree_digest

import tdckpt
from tdckpt._restore import build
from tdckpt.errors import RestoreError, TdckptError

tensordict = pytest.importorskip("tensordict")
from tensordict import TensorDict  # noqa: E402
from tensordict._lazy import (  # noqa: E402
    _PermutedTensorDict,
    _SqueezedTensorDict,
    _TransposedTensorDict,
    _UnsqueezedTensorDict,
    _ViewedTensorDict,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _source() -> Any:
    return TensorDict(
        a=torch.arange(24.0).reshape(2, 3, 4),
        b=torch.arange(6).reshape(2, 3),
        n=TensorDict(c=torch.arange(12).reshape(2, 3, 2), batch_size=[2, 3]),
        batch_size=[2, 3],
    )


def _views() -> dict[str, Any]:
    td = _source()
    return {
        "sub_slice": td._get_sub_tensordict(slice(0, 1)),
        "sub_int": td._get_sub_tensordict(1),
        "sub_tuple": td._get_sub_tensordict((slice(None), 2)),
        "sub_ellipsis": td._get_sub_tensordict((Ellipsis, 1)),
        "sub_tensor": td._get_sub_tensordict(torch.tensor([1, 0])),
        "sub_mask": td._get_sub_tensordict((slice(None), torch.tensor([True, False, True]))),
        "sub_none": td._get_sub_tensordict((None, 0)),
        "unsqueeze": _UnsqueezedTensorDict(
            td,
            custom_op="unsqueeze",
            inv_op="squeeze",
            custom_op_kwargs={"dim": 1},
            inv_op_kwargs={"dim": 1},
        ),
        "squeeze": _SqueezedTensorDict(
            td.unsqueeze(0),
            custom_op="squeeze",
            inv_op="unsqueeze",
            custom_op_kwargs={"dim": 0},
            inv_op_kwargs={"dim": 0},
        ),
        "permute": _PermutedTensorDict(
            td,
            custom_op="permute",
            inv_op="permute",
            custom_op_kwargs={"dims": [1, 0]},
            inv_op_kwargs={"dims": [1, 0]},
        ),
        "transpose": _TransposedTensorDict(
            td,
            custom_op="transpose",
            inv_op="transpose",
            custom_op_kwargs={"dim0": 0, "dim1": 1},
            inv_op_kwargs={"dim0": 0, "dim1": 1},
        ),
        "view": _ViewedTensorDict(
            td,
            custom_op="view",
            inv_op="view",
            custom_op_kwargs={"size": [6]},
            inv_op_kwargs={"size": [2, 3]},
        ),
    }


CASES = sorted(_views())


def _write(tmp_path: Path, name: str) -> Path:
    prefix = tmp_path / name
    _views()[name].memmap(prefix)
    return prefix


def _leaf_keys(td: Any) -> list[tuple[str, ...]]:
    out = []
    for k in td.keys():  # noqa: SIM118 - iterating a TensorDict walks its batch dimension, not its keys
        v = td.get(k)
        if isinstance(v, torch.Tensor):
            out.append((k,))
        else:
            out.extend((k, *sub) for sub in _leaf_keys(v))
    return sorted(out)


def _get(td: Any, key: tuple[str, ...]) -> Any:
    for k in key:
        td = td[k]
    return td


def _assert_same(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    assert ours.batch_size == theirs.batch_size
    assert sorted(ours.keys()) == sorted(theirs.keys())
    keys = _leaf_keys(theirs)
    assert _leaf_keys(ours) == keys
    for key in keys:
        a, b = _get(ours, key), _get(theirs, key)
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), key
    for k in theirs.keys():  # noqa: SIM118 - iterating a TensorDict walks its batch dimension, not its keys
        assert type(ours.get(k)) is type(theirs.get(k)), k
    if hasattr(theirs, "idx"):
        assert ours.idx.__repr__() == theirs.idx.__repr__()
    if hasattr(theirs, "custom_op"):
        assert (ours.custom_op, ours.custom_op_kwargs, ours.inv_op, ours.inv_op_kwargs) == (
            theirs.custom_op,
            theirs.custom_op_kwargs,
            theirs.inv_op,
            theirs.inv_op_kwargs,
        )


@pytest.mark.parametrize("name", CASES)
def test_differential_against_tensordict(tmp_path: Path, name: str) -> None:
    prefix = _write(tmp_path, name)
    before = tree_digest(prefix)
    report = tdckpt.validate(prefix)
    assert report.ok, [str(p) for p in report.problems]
    ours = tdckpt.load_memmap(prefix)
    theirs = TensorDict.load_memmap(prefix)
    _assert_same(ours, theirs)
    assert ours.batch_size == _views()[name].batch_size
    info = tdckpt.inspect(prefix)
    kind = "sub-tensordict" if name.startswith("sub_") else "lazy-view"
    assert info.root.kind == kind
    meta = json.loads((prefix / "meta.json").read_text())
    # the class as tensordict 0.15.3 records it; an older writer records only _type, and
    # tdckpt names the class all the same (real module, for these private classes)
    assert ("_class" in meta) is WRITES_FORMAT_VERSION
    cls = type(_views()[name])
    assert info.root.class_name == meta.get("_class", f"{cls.__module__}:{cls.__qualname__}")
    assert info.root.batch_size == list(theirs.batch_size)
    assert [c.kind for c in info.root.children] == ["tensordict"]
    assert tree_digest(prefix) == before


@pytest.mark.parametrize("name", CASES)
def test_plain_dict_backend_materializes_the_values(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _write(tmp_path, name)
    theirs = TensorDict.load_memmap(prefix)
    monkeypatch.setattr(build, "has_tensordict", lambda: False)
    ours = tdckpt.load_memmap(prefix)
    assert isinstance(ours, dict)
    keys = _leaf_keys(theirs)
    assert _leaf_keys(ours) == keys
    for key in keys:
        assert torch.equal(_get(ours, key), _get(theirs, key)), key


def test_plain_dict_backend_refuses_an_unfaithful_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _write(tmp_path, "squeeze")
    meta = json.loads((prefix / "meta.json").read_text())
    meta["custom_op_kwargs"] = {}
    (prefix / "meta.json").write_text(json.dumps(meta))
    assert tdckpt.validate(prefix).ok  # tensordict loads a squeeze() without dim
    monkeypatch.setattr(build, "has_tensordict", lambda: False)
    with pytest.raises(RestoreError, match="squeeze"):
        tdckpt.load_memmap(prefix)


def test_nested_sub_tensordict_and_in_place(tmp_path: Path) -> None:
    td = _source()
    outer = TensorDict(x=td._get_sub_tensordict(slice(0, 1)), y=torch.zeros(1), batch_size=[1])
    prefix = tmp_path / "nested"
    outer.memmap(prefix)
    assert tdckpt.validate(prefix).ok
    ours, theirs = tdckpt.load_memmap(prefix), TensorDict.load_memmap(prefix)
    assert type(ours["x"]) is type(theirs["x"])
    _assert_same(ours["x"], theirs["x"])
    assert torch.equal(ours["y"], theirs["y"])
    info = tdckpt.inspect(prefix)
    assert [c.kind for c in info.root.children if c.key == ("x",)] == ["sub-tensordict"]

    target = TensorDict(
        x=TensorDict(a=torch.zeros(1, 3, 4), batch_size=[1]), y=torch.ones(1), batch_size=[1]
    )
    out = tdckpt.load_memmap_(target, prefix)
    assert out is target
    _assert_same(target["x"], theirs["x"])


def test_in_place_at_the_root_is_refused_and_the_target_unchanged(tmp_path: Path) -> None:
    prefix = _write(tmp_path, "sub_slice")
    target = TensorDict(a=torch.zeros(1, 3, 4), batch_size=[1])
    with pytest.raises(RestoreError):
        tdckpt.load_memmap_(target, prefix)
    assert sorted(target.keys()) == ["a"] and torch.equal(target["a"], torch.zeros(1, 3, 4))


# -- the 0.3 (G2) layout -------------------------------------------------------------------------

_TD_TYPE = "<class 'tensordict._td.TensorDict'>"


def _g2_source(prefix: Path) -> None:
    src = prefix / "_source"
    src.mkdir(parents=True)
    torch.arange(12.0).reshape(4, 3).numpy().tofile(src / "a.memmap")
    meta = {
        "a": {"device": "cpu", "shape": [4, 3], "dtype": "torch.float32"},
        "shape": [4],
        "device": "cpu",
        "_type": _TD_TYPE,
    }
    (src / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "meta",
    [
        {"_type": "<class 'tensordict._td._SubTensorDict'>", "index": [1]},
        {"_type": "<class 'tensordict._td._SubTensorDict'>", "index": 2},
        {
            "_type": "<class 'tensordict._td._SubTensorDict'>",
            "index": ["tuple", [["slice", {"start": 1, "stop": None, "step": 2}]]],
        },
        {
            "shape": [4, 1],
            "device": "cpu",
            "_type": "<class 'tensordict._lazy._UnsqueezedTensorDict'>",
            "custom_op": "unsqueeze",
            "inv_op": "squeeze",
            "custom_op_kwargs": {"dim": 1},
            "inv_op_kwargs": {"dim": 1},
        },
    ],
    ids=["legacy-tuple", "legacy-int", "tagged-slice", "unsqueeze"],
)
def test_g2_layout_reads_as_tensordict_reads_it_and_upgrades(
    tmp_path: Path, meta: dict[str, Any]
) -> None:
    prefix = tmp_path / "g2"
    _g2_source(prefix)
    (prefix / "meta.json").write_text(json.dumps(meta))
    assert tdckpt.validate(prefix).ok, [str(p) for p in tdckpt.validate(prefix).problems]
    theirs = TensorDict.load_memmap(prefix)
    _assert_same(tdckpt.load_memmap(prefix), theirs)

    tdckpt.upgrade(prefix, backup=False)
    written = json.loads((prefix / "meta.json").read_text())
    assert written["_format_version"] == 1
    assert tdckpt.validate(prefix).ok
    _assert_same(TensorDict.load_memmap(prefix), theirs)
    _assert_same(tdckpt.load_memmap(prefix), theirs)


def test_upgrade_of_a_current_view_keeps_it_loadable(tmp_path: Path) -> None:
    prefix = _write(tmp_path, "sub_tensor")
    theirs = TensorDict.load_memmap(prefix)
    tdckpt.upgrade(prefix, backup=False)
    _assert_same(TensorDict.load_memmap(prefix), theirs)


# -- hostile variants ----------------------------------------------------------------------------


def _edit(prefix: Path, **fields: Any) -> None:
    meta = json.loads((prefix / "meta.json").read_text())
    for k, v in fields.items():
        if v is _DROP:
            meta.pop(k, None)
        else:
            meta[k] = v
    (prefix / "meta.json").write_text(json.dumps(meta))


_DROP = object()


def _deep(n: int) -> Any:
    out: Any = 0
    for _ in range(n):
        out = ["tuple", [out]]
    return out


HOSTILE = {
    "index-out-of-range": ("sub_int", {"index": ["tuple", [7]]}, "bad-index"),
    "negative-out-of-range": ("sub_int", {"index": ["tuple", [-3]]}, "bad-index"),
    "tensor-out-of-range": (
        "sub_tensor",
        {"index": ["tuple", [["tensor", [0, 5], "cpu"]]]},
        "bad-index",
    ),
    "too-many-indices": ("sub_int", {"index": ["tuple", [0, 0, 0]]}, "bad-index"),
    "mask-wrong-shape": ("sub_int", {"index": ["tuple", [["tensor", [True], "cpu"]]]}, "bad-index"),
    "string-index": ("sub_int", {"index": "os.system"}, "bad-index"),
    "dict-index": ("sub_int", {"index": {"__class__": "x"}}, "bad-index"),
    "unknown-tag": ("sub_int", {"index": ["pickle", "abc"]}, "bad-index"),
    "float-index": ("sub_int", {"index": 1.5}, "bad-index"),
    "zero-step": (
        "sub_slice",
        {"index": ["tuple", [["slice", {"start": 0, "stop": 1, "step": 0}]]]},
        "bad-index",
    ),
    "cuda-index": ("sub_tensor", {"index": ["tuple", [["tensor", [0], "cuda:0"]]]}, "bad-index"),
    "huge-index": (
        "sub_tensor",
        {"index": ["tuple", [["tensor", [0] * 1_000_001, "cpu"]]]},
        "bad-index",
    ),
    "huge-range": (
        "sub_tensor",
        {"index": ["tuple", [["range", {"start": 0, "stop": 10**15, "step": 1}]]]},
        "bad-index",
    ),
    "deep-index": ("sub_int", {"index": _deep(200)}, "bad-index"),
    "missing-index": ("sub_int", {"index": _DROP}, "schema"),
    # the same in a pre-format-version-1 file (what tensordict 0.14 - 0.15.2 write), which
    # the upgrade to version 1 reads: regression - the missing index became "index": null,
    # read as the index None, and the checkpoint restored silently as source[None]
    "missing-index-unmarked": (
        "sub_int",
        {"index": _DROP, "_format_version": _DROP, "_class": _DROP},
        "schema",
    ),
    "unknown-op": ("unsqueeze", {"custom_op": "__getattribute__"}, "bad-view"),
    "unknown-inv-op": ("unsqueeze", {"inv_op": "exec"}, "bad-view"),
    "bad-kwargs": ("unsqueeze", {"custom_op_kwargs": {"dim": 1, "out": 2}}, "bad-view"),
    "kwargs-not-int": ("unsqueeze", {"custom_op_kwargs": {"dim": "1"}}, "bad-view"),
    "dim-out-of-range": ("unsqueeze", {"custom_op_kwargs": {"dim": 9}}, "bad-view"),
    "negative-dim": ("transpose", {"custom_op_kwargs": {"dim0": -1, "dim1": 0}}, "bad-view"),
    "not-a-permutation": ("permute", {"custom_op_kwargs": {"dims": [0, 0]}}, "bad-view"),
    "view-wrong-numel": ("view", {"custom_op_kwargs": {"size": [7]}}, "bad-view"),
    "inverse-mismatch": ("view", {"inv_op_kwargs": {"size": [3, 2]}}, "bad-view"),
    "missing-kwargs": ("view", {"inv_op_kwargs": _DROP}, "bad-view"),
    "shape-mismatch": ("unsqueeze", {"shape": [2, 3, 1]}, "batch-mismatch"),
    "unknown-class": ("unsqueeze", {"_class": "os:system"}, "unknown-class"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_variants_are_reported_and_refused(tmp_path: Path, case: str) -> None:
    name, fields, code = HOSTILE[case]
    prefix = _write(tmp_path, name)
    _edit(prefix, **fields)
    before = tree_digest(prefix)
    report = tdckpt.validate(prefix)
    assert not report.ok
    assert code in {p.code for p in report.problems if p.severity == "error"}, [
        str(p) for p in report.problems
    ]
    problem = next(p for p in report.problems if p.code == code)
    assert problem.path.endswith("meta.json") and problem.message
    with pytest.raises(TdckptError):
        tdckpt.load_memmap(prefix)
    target = TensorDict(a=torch.zeros(2), batch_size=[2])
    with pytest.raises(TdckptError):
        tdckpt.load_memmap_(target, prefix)
    assert sorted(target.keys()) == ["a"]
    assert tree_digest(prefix) == before


@pytest.mark.parametrize("name", ["sub_int", "unsqueeze"])
def test_missing_or_broken_source_is_reported(tmp_path: Path, name: str) -> None:
    prefix = _write(tmp_path, name)
    shutil.rmtree(prefix / "_source")
    report = tdckpt.validate(prefix)
    assert "missing-child" in {p.code for p in report.problems}
    with pytest.raises(TdckptError):
        tdckpt.load_memmap(prefix)

    prefix = _write(tmp_path / "again", name)
    (prefix / "_source" / "a.memmap").write_bytes(b"")
    report = tdckpt.validate(prefix)
    assert "short-file" in {p.code for p in report.problems}
    with pytest.raises(TdckptError):
        tdckpt.load_memmap(prefix)


@pytest.mark.filterwarnings("ignore::tdckpt.warnings.TdckptWarning")
def test_g1_lazy_view_is_restored_from_its_migrated_source(tmp_path: Path) -> None:
    """tensordict <= 0.2 wrote a view's source leaves beside a meta.pt holding the op."""
    prefix = tmp_path / "g1"
    prefix.mkdir()
    head = {
        "batch_size": torch.Size([3]),
        "device": None,
        "custom_op": "unsqueeze",
        "inv_op": "squeeze",
        "custom_op_kwargs": {"dim": 0},
        "inv_op_kwargs": {"dim": 0},
    }
    torch.save(head, prefix / "meta.pt")
    torch.save(
        {"shape": torch.Size([3, 2]), "device": torch.device("cpu"), "dtype": torch.float32},
        prefix / "a.meta.pt",
    )
    torch.arange(6.0).reshape(3, 2).numpy().tofile(prefix / "a.memmap")
    report = tdckpt.validate(prefix)
    assert report.ok, [str(p) for p in report.problems]
    out = tdckpt.load_memmap(prefix)
    assert type(out) is _UnsqueezedTensorDict and out.batch_size == torch.Size([1, 3])
    assert torch.equal(out["a"], torch.arange(6.0).reshape(1, 3, 2))
    assert tdckpt.inspect(prefix).root.kind == "lazy-view"
    tdckpt.upgrade(prefix, backup=False)
    _assert_same(TensorDict.load_memmap(prefix), out)
