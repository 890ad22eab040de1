"""Every check of ``tdckpt/_read/validate.py``, one test each (found by a mutation pass).

Each test damages one thing in a copy of a real tensordict-written checkpoint and asserts
that validation names it (code, key) - and, at each boundary, that the value just inside
passes. ``tools/mutate.py`` applies one deliberate mutation per check (negated condition,
off-by-one, deleted check) and shows that one of these tests then fails; the table of
mutants and the tests that kill them is in the notes of issue 9.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _tdversion import WRITES_FORMAT_VERSION
from conftest import EXTRA_FIXTURES, copy_case, fixture_cases, tree_digest
from fixture_types import FixtureTC
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict

import tdckpt
from tdckpt.errors import PickleNotAllowedError, ValidationError


def _base() -> TensorDict:
    td = TensorDict(
        a=torch.arange(6.0).reshape(2, 3),
        n=TensorDict(b=torch.ones(2, 4, dtype=torch.int64), batch_size=[2, 4]),
        batch_size=[2],
        names=["x"],
    )
    with warnings.catch_warnings():  # torch: "nested tensors are in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        td["nt"] = torch.nested.nested_tensor([torch.ones(3), torch.ones(2)])
    td["s"] = LazyStackedTensorDict(
        TensorDict(c=torch.ones(2, 1), batch_size=[2]),
        TensorDict(c=torch.ones(2, 1), batch_size=[2]),
        stack_dim=1,
    )
    td["v"] = NonTensorData("hello", batch_size=[2])
    td["ns"] = NonTensorStack("p", "q")
    td["tc"] = FixtureTC(
        obs=torch.ones(2, 2), reward=torch.ones(2), label="l", extra="e", batch_size=[2]
    )
    td["z"] = torch.zeros(2, 0)
    return td


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A checkpoint tensordict 0.15.3 wrote: leaves, nested, nested tensor, stacks, tc."""
    prefix = tmp_path / "ckpt"
    _base().memmap(prefix)
    if not WRITES_FORMAT_VERSION:
        # These checks edit format version 1 (what 0.15.3 writes); an older writer's tree
        # is brought there by tdckpt's own upgrade (0.14 loses the dimension names).
        tdckpt.upgrade(prefix, backup=False)
        _edit(prefix, "", lambda m: m.__setitem__("_names", ["x"]))
    return prefix


def _edit(prefix: Path, rel: str, change: Callable[[dict[str, Any]], Any]) -> None:
    path = prefix / rel / "meta.json"
    meta = json.loads(path.read_text(encoding="utf-8"))
    change(meta)
    path.write_text(json.dumps(meta), encoding="utf-8")


def _errors(prefix: Path) -> list[tuple[str, tuple[str, ...]]]:
    return [(p.code, p.key) for p in tdckpt.validate(prefix).errors]


def _refused(prefix: Path, code: str, key: tuple[str, ...], text: str = "") -> None:
    """validate names (code, key) and the restore refuses, with the prefix unchanged."""
    report = tdckpt.validate(prefix)
    hits = [p for p in report.errors if p.code == code and p.key == key]
    assert hits, [(p.code, p.key, p.message) for p in report.problems]
    assert text in hits[0].message, hits[0].message
    disk = tree_digest(prefix)
    with pytest.raises(ValidationError):
        tdckpt.load_memmap(prefix)
    assert tree_digest(prefix) == disk


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def test_the_base_checkpoint_is_valid(ckpt: Path) -> None:
    assert _errors(ckpt) == []
    out = tdckpt.load_memmap(ckpt)
    assert out["a"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert out["s"].stack_dim == 1 and tuple(out["s"].batch_size) == (2, 2)


# -- level structure -------------------------------------------------------------------


def test_a_listed_child_without_meta_json(ckpt: Path) -> None:
    (ckpt / "n" / "meta.json").unlink()
    _refused(ckpt, "missing-meta", ("n",))


def test_an_unreadable_meta_json_is_reported_once_under_its_key(ckpt: Path) -> None:
    (ckpt / "n" / "meta.json").write_text("{not json", encoding="utf-8")
    errors = _errors(ckpt)
    assert errors and all(key == ("n",) for _, key in errors), errors
    assert "missing-meta" not in {code for code, _ in errors}
    with pytest.raises(ValidationError):
        tdckpt.load_memmap(ckpt)


def test_a_listed_child_directory_is_missing(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "n")
    _refused(ckpt, "missing-child", ("n",))


@pytest.mark.parametrize(
    "cls", ["tensordict:Bogus", "evil:TensorDict", "tensordictx.mod:TensorDict"]
)
def test_an_unknown_tensordict_class(ckpt: Path, cls: str) -> None:
    _edit(ckpt, "n", lambda m: m.update(_class=cls))
    _refused(ckpt, "unknown-class", ("n",))


def test_a_known_tensordict_class_in_a_submodule_passes(ckpt: Path) -> None:
    _edit(ckpt, "n", lambda m: m.update(_class="tensordict._td:TensorDict"))
    assert _errors(ckpt) == []


def test_a_level_device_torch_does_not_know(ckpt: Path) -> None:
    _edit(ckpt, "n", lambda m: m.update(device="warp-drive"))
    _refused(ckpt, "bad-device", ("n",))


@pytest.mark.parametrize("names", [["x"], ["x", None, None]])
def test_names_must_match_the_batch_dims(ckpt: Path, names: list[Any]) -> None:
    _edit(ckpt, "n", lambda m: m.update(_names=names))
    _refused(ckpt, "bad-names", ("n",), "dimension names")


def test_a_nested_level_must_start_with_its_parents_batch(ckpt: Path) -> None:
    def change(m: dict[str, Any]) -> None:
        m["shape"] = [3, 4]
        m["_names"] = [None, None]
        m["b"]["shape"] = [3, 4]

    _edit(ckpt, "n", change)
    (ckpt / "n" / "b.memmap").write_bytes(b"\0" * (3 * 4 * 8))
    _refused(ckpt, "batch-mismatch", ("n",), "parent's")


def test_a_tensorclass_must_start_with_its_parents_batch(ckpt: Path) -> None:
    def change(m: dict[str, Any]) -> None:
        m["shape"] = [1]
        for leaf in ("obs", "reward"):
            m[leaf]["shape"][0] = 1

    _edit(ckpt, "tc/_tensordict", change)
    _refused(ckpt, "batch-mismatch", ("tc",), "parent's")


# -- leaves ------------------------------------------------------------------------------


def test_an_unknown_dtype(ckpt: Path) -> None:
    _edit(ckpt, "", lambda m: m["a"].update(dtype="torch.float128"))
    _refused(ckpt, "unknown-dtype", ("a",))


def test_a_shape_that_overflows(ckpt: Path) -> None:
    _edit(ckpt, "", lambda m: m["a"].update(shape=[2, 2**61]))  # 2**62 float32: 2**64 bytes
    _refused(ckpt, "bad-shape", ("a",), "overflows")


def test_a_shape_of_exactly_max_bytes_is_only_short(ckpt: Path) -> None:
    _edit(ckpt, "", lambda m: m["a"].update(shape=[2, 2**59]))  # 2**60 float32: 2**62 bytes
    _refused(ckpt, "short-file", ("a",))


def test_a_leaf_that_does_not_start_with_the_batch(ckpt: Path) -> None:
    _edit(ckpt, "", lambda m: m["a"].update(shape=[3, 2]))
    _refused(ckpt, "batch-mismatch", ("a",), "does not start with the batch size")


def test_a_missing_leaf_file(ckpt: Path) -> None:
    (ckpt / "a.memmap").unlink()
    _refused(ckpt, "missing-file", ("a",))


def test_a_zero_element_leaf_needs_no_file(ckpt: Path) -> None:
    zero = ckpt / "z.memmap"
    if zero.exists():
        zero.unlink()
    assert _errors(ckpt) == []
    assert tuple(tdckpt.load_memmap(ckpt)["z"].shape) == (2, 0)


def test_a_zero_element_leaf_does_not_claim_a_file(ckpt: Path) -> None:
    # Two keys whose names fall back to one file: "." is stored as %2E, and a zero-element
    # "%2E" must not claim (and collide with) it, since it reads nothing.
    prefix = ckpt.parent / "odd"
    td = TensorDict({".": torch.ones(2), "%2E": torch.zeros(2, 0)}, batch_size=[2])
    td.memmap(prefix)
    assert _errors(prefix) == []
    out = tdckpt.load_memmap(prefix)
    assert out["."].tolist() == [1.0, 1.0] and tuple(out["%2E"].shape) == (2, 0)


def test_a_leaf_one_byte_short(ckpt: Path) -> None:
    _truncate(ckpt / "a.memmap", 6 * 4 - 1)
    _refused(ckpt, "short-file", ("a",), "23 bytes")


def test_a_leaf_of_exactly_its_size_and_one_longer_pass(ckpt: Path) -> None:
    assert (ckpt / "a.memmap").stat().st_size == 24
    assert _errors(ckpt) == []
    with open(ckpt / "a.memmap", "ab") as f:
        f.write(b"\0")
    assert _errors(ckpt) == []


# -- nested tensors ------------------------------------------------------------------------


def _sizes(ckpt: Path, rows: list[list[int]]) -> None:
    (ckpt / "nt.shape.memmap").write_bytes(torch.tensor(rows, dtype=torch.int64).numpy().tobytes())


@pytest.mark.parametrize("shape", [[2], [2, 1, 1]])
def test_a_nested_size_table_must_be_two_dimensional(ckpt: Path, shape: list[int]) -> None:
    _edit(ckpt, "", lambda m: m["nt"].update(shape=shape))
    _refused(ckpt, "bad-shape", ("nt",), "size table's shape")


def test_a_nested_size_table_file_is_missing(ckpt: Path) -> None:
    (ckpt / "nt.shape.memmap").unlink()
    _refused(ckpt, "missing-file", ("nt",), "size table")


def test_a_nested_size_table_one_byte_short(ckpt: Path) -> None:
    _truncate(ckpt / "nt.shape.memmap", 2 * 8 - 1)
    _refused(ckpt, "short-file", ("nt",), "size table")


def test_a_nested_size_table_with_a_negative_size(ckpt: Path) -> None:
    _sizes(ckpt, [[3], [-1]])
    _refused(ckpt, "bad-shape", ("nt",), "negative")


@pytest.mark.parametrize("rows", [[[2**62 + 1], [0]], [[2**61], [2**61]]])
def test_a_nested_size_table_that_claims_too_much(ckpt: Path, rows: list[list[int]]) -> None:
    _sizes(ckpt, rows)
    _refused(ckpt, "bad-shape", ("nt",), "size table claims")


def test_a_nested_size_table_with_one_impossible_dimension(ckpt: Path) -> None:
    # Few elements in all (a zero beside it), but a dimension no tensor can have.
    _edit(ckpt, "", lambda m: m["nt"].update(shape=[2, 2]))
    _sizes(ckpt, [[3, 1], [2**62 + 1, 0]])
    _refused(ckpt, "bad-shape", ("nt",), "a dimension no tensor can have")


def test_a_nested_tensor_must_match_the_batch(ckpt: Path) -> None:
    _edit(ckpt, "", lambda m: m["nt"].update(shape=[3, 1]))
    _sizes(ckpt, [[3], [2], [0]])
    _refused(ckpt, "batch-mismatch", ("nt",), "nested tensor of 3 elements")


def test_a_nested_data_file_one_element_short(ckpt: Path) -> None:
    _truncate(ckpt / "nt.memmap", 5 * 4 - 1)
    _refused(ckpt, "short-file", ("nt",))


# -- lazy stacks -----------------------------------------------------------------------------


def test_lazy_stack_members_with_different_batch_sizes(ckpt: Path) -> None:
    def change(m: dict[str, Any]) -> None:
        m["shape"] = [2, 1]
        m["_names"] = ["x", None]

    _edit(ckpt, "s/1", change)
    _refused(ckpt, "stack-mismatch", ("s",), "different batch sizes")


def test_lazy_stack_members_on_different_devices(ckpt: Path) -> None:
    _edit(ckpt, "s/1", lambda m: m.update(device="meta"))
    _refused(ckpt, "stack-mismatch", ("s",), "different devices")


def test_a_stack_dim_past_the_members_batch_dims(ckpt: Path) -> None:
    _edit(ckpt, "s", lambda m: m.update(stack_dim=2))
    _refused(ckpt, "bad-shape", ("s",), "stack_dim 2")


def test_a_stack_dim_equal_to_the_members_batch_dims_passes(ckpt: Path) -> None:
    assert json.loads((ckpt / "s" / "meta.json").read_text())["stack_dim"] == 1
    assert _errors(ckpt) == []


# -- non-tensor data -------------------------------------------------------------------------


def _types_case(tmp_path: Path) -> Path:
    (fc,) = fixture_cases(
        root=EXTRA_FIXTURES, versions=["0.15.1"], where=lambda c: c.name == "non_tensor_types"
    )
    return copy_case(tmp_path, fc)


def _load_without_pickle(prefix: Path) -> Any:
    return tdckpt.load_memmap(prefix, allow_pickle=False)


def test_json_types_matching_the_pickle_restore_without_unpickling(tmp_path: Path) -> None:
    prefix = _types_case(tmp_path)
    assert _errors(prefix) == []
    out = _load_without_pickle(prefix)
    assert out["_pytree_type"] is dict and out["b", "_pytree_type"] is tuple


def test_json_types_with_a_wrong_sha256_are_not_trusted(tmp_path: Path) -> None:
    prefix = _types_case(tmp_path)
    path = prefix / "_pytree_type" / "json_types.json"
    saved = json.loads(path.read_text())
    saved["pickle_sha256"] = "0" * 64
    path.write_text(json.dumps(saved))
    # Then the types are not known without the pickle: it is pickled data again.
    with pytest.raises(PickleNotAllowedError):
        _load_without_pickle(prefix)


def test_json_types_without_their_pickle_are_not_used(tmp_path: Path) -> None:
    prefix = _types_case(tmp_path)
    (prefix / "_pytree_type" / "other.pickle").unlink()
    _refused(prefix, "missing-file", ("_pytree_type",), "neither inline data nor its other.pickle")


def test_json_types_naming_an_unknown_type(tmp_path: Path) -> None:
    prefix = _types_case(tmp_path)
    path = prefix / "_pytree_type" / "json_types.json"
    saved = json.loads(path.read_text())
    saved["types"] = {"data": "os.system"}
    path.write_text(json.dumps(saved))
    report = tdckpt.validate(prefix)
    assert [p.code for p in report.errors] == ["schema"], report.problems
    assert "unknown type names" in report.errors[0].message


def test_a_non_tensor_without_data_or_pickle(ckpt: Path) -> None:
    _edit(ckpt, "v", lambda m: m.pop("data"))
    _refused(ckpt, "missing-file", ("v",), "neither inline data")


def test_metadata_is_restored_as_metadata(tmp_path: Path) -> None:
    from tensordict.tensorclass import MetaData

    prefix = tmp_path / "md"
    TensorDict(
        m=MetaData("info", batch_size=[2]), v=NonTensorData("x", batch_size=[2]), batch_size=[2]
    ).memmap(prefix)
    out = tdckpt.load_memmap(prefix)
    assert type(out.get("m")).__name__ == "MetaData"
    assert type(out.get("v")).__name__ == "NonTensorData"


def _nested_list(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def test_a_non_tensor_stack_nested_past_64_levels(ckpt: Path) -> None:
    _edit(ckpt, "ns", lambda m: m.update(data=[_nested_list(64), _nested_list(64)]))
    _refused(ckpt, "bad-shape", ("ns",), "64 levels")


def test_a_non_tensor_stack_nested_64_levels_passes_validation(ckpt: Path) -> None:
    _edit(ckpt, "ns", lambda m: m.update(data=[_nested_list(63), _nested_list(63)]))
    assert "bad-shape" not in {code for code, _ in _errors(ckpt)}


def test_a_non_tensor_stack_must_match_the_batch(ckpt: Path) -> None:
    _edit(ckpt, "ns", lambda m: m.update(data=["p", "q", "r"]))
    _refused(ckpt, "batch-mismatch", ("ns",), "a stack of 3 values")


def test_a_non_tensor_stack_device_torch_does_not_know(ckpt: Path) -> None:
    _edit(ckpt, "ns", lambda m: m.update(device="warp-drive"))
    _refused(ckpt, "bad-device", ("ns",))


def test_a_pickled_non_tensor_stack_without_pickle_pkl(tmp_path: Path) -> None:
    (fc,) = fixture_cases(
        root=EXTRA_FIXTURES, versions=["0.15.1"], where=lambda c: c.name == "non_tensor_stack"
    )
    prefix = copy_case(tmp_path, fc)
    assert _errors(prefix) == []
    (prefix / "points" / "pickle.pkl").unlink()
    _refused(prefix, "missing-file", ("points",), "pickle.pkl is missing")


# -- tensorclasses ---------------------------------------------------------------------------


def test_a_tensorclass_without_its_tensordict(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "tc" / "_tensordict")
    _refused(ckpt, "missing-child", ("tc",), "_tensordict")


def test_a_tensorclass_whose_tensordict_is_not_a_tensordict_level(ckpt: Path) -> None:
    inner = ckpt / "tc" / "_tensordict"
    shutil.rmtree(inner)
    shutil.copytree(ckpt / "s", inner)
    _refused(ckpt, "schema", ("tc",), "must be a TensorDict level")


# -- schema errors -----------------------------------------------------------------------------


def test_a_broken_leaf_entry_reports_only_the_leaf_fields(ckpt: Path) -> None:
    _edit(ckpt, "", lambda m: m["a"].update(shape="wide"))
    report = tdckpt.validate(ckpt)
    assert report.errors and all(p.code == "schema" and p.key == ("a",) for p in report.errors), (
        report.problems
    )
    assert all("'type'" not in p.message for p in report.errors), [p.message for p in report.errors]
    assert "entry 'a' field 'shape'" in report.errors[0].message


def test_a_broken_child_entry_reports_only_the_child_fields(ckpt: Path) -> None:
    _edit(ckpt, "", lambda m: m["n"].update(type=7))
    report = tdckpt.validate(ckpt)
    assert report.errors and all(p.key == ("n",) for p in report.errors), report.problems
    assert all("dtype" not in p.message for p in report.errors), [p.message for p in report.errors]


def test_a_broken_level_field_names_the_field(ckpt: Path) -> None:
    _edit(ckpt, "n", lambda m: m.update(shape="wide"))
    _refused(ckpt, "schema", ("n",), "field 'shape'")


def test_the_format_version_is_checked_before_validation(ckpt: Path) -> None:
    """validate.py has no newer-format branch: detection refuses such a tree first."""
    _edit(ckpt, "n", lambda m: m.update(_format_version=2))
    report = tdckpt.validate(ckpt)
    assert [p.code for p in report.errors] == ["unsupported-format"], report.problems
    assert os.fspath(Path("n") / "meta.json") in report.errors[0].message


# -- views nested in a level -------------------------------------------------------------------


def _nested_view(tmp_path: Path, parent_batch: list[int]) -> Path:
    """A saved _SubTensorDict (batch [3]) moved under a TensorDict level of ``parent_batch``."""
    source = TensorDict(b=torch.arange(6).reshape(2, 3), batch_size=[2, 3])
    view_dir = tmp_path / "view"
    source._get_sub_tensordict(1).memmap(view_dir)
    prefix = tmp_path / "ckpt"
    TensorDict(batch_size=parent_batch).memmap(prefix)
    shutil.move(view_dir, prefix / "v")
    _edit(prefix, "", lambda m: m.update(v={"type": "_SubTensorDict"}))
    return prefix


def test_a_nested_view_must_start_with_its_parents_batch(tmp_path: Path) -> None:
    _refused(_nested_view(tmp_path, [5]), "batch-mismatch", ("v",), "parent's")


def test_a_nested_view_with_the_parents_batch_passes(tmp_path: Path) -> None:
    prefix = _nested_view(tmp_path, [3])
    assert _errors(prefix) == []
    assert tdckpt.load_memmap(prefix)["v", "b"].tolist() == [3, 4, 5]
