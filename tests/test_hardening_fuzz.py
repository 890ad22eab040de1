"""The crash classes the metadata fuzzer found, each as the exact mutant it found.

``tests/property/test_fuzz_metadata.py`` mutates real checkpoints; every mutant that
validation accepted but the restore could not build (a RuntimeError, ValueError,
AttributeError or an unexplained RestoreError) is pinned here: validation now reports it,
and the restore refuses it with a TdckptError, the target and the prefix untouched.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fixture_types
import pytest
import torch
from conftest import copy_case, fixture_cases, tree_digest
from tensordict import LazyStackedTensorDict, TensorDict, is_tensorclass, tensorclass

import tdckpt
from tdckpt.errors import RestoreError, TdckptError, ValidationError
from tdckpt.manager import CheckpointManager
from tdckpt.schema import FileRecord

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _case(tmp_path: Path, version: str, name: str) -> Path:
    (fc,) = fixture_cases(versions=[version], where=lambda fc: fc.name == name)
    return copy_case(tmp_path, fc)


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def _state(obj: Any) -> Any:
    """Identities of every level and leaf, batch sizes and lock state (what must not change)."""
    if isinstance(obj, torch.Tensor):
        return id(obj)
    if isinstance(obj, LazyStackedTensorDict):
        return ("stack", id(obj), obj.is_locked, [_state(m) for m in obj.tensordicts])
    if is_tensorclass(obj):
        return ("tc", id(obj), dict(obj._non_tensordict), _state(obj._tensordict))
    if isinstance(obj, TensorDict):
        items = {k: _state(v) for k, v in obj._tensordict.items()}
        return ("td", id(obj), tuple(obj.batch_size), obj.is_locked, items)
    return ("other", id(obj))


def _refused_untouched(prefix: Path, target: Any, code: str) -> ValidationError:
    """validate reports ``code``; both restores refuse it; target and prefix unchanged."""
    before = tree_digest(prefix)
    report = tdckpt.validate(prefix)
    assert code in [p.code for p in report.errors], report.errors
    with pytest.raises(ValidationError):
        tdckpt.load_memmap(prefix, allow_pickle=True)
    state = _state(target)
    with pytest.raises(ValidationError) as info:
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert _state(target) == state
    assert tree_digest(prefix) == before
    return info.value


# -- tensorclass names that resolve to something else --------------------------------------


def test_a_tensorclass_type_naming_tensordict_is_refused(tmp_path: Path) -> None:
    # Found on 0.3.2-tensorclass_in_td: tc/meta.json _type = TensorDict. It resolved through
    # tensordict's accepted classes to TensorDict, and the build crashed with
    # "AttributeError: type object 'TensorDict' has no attribute '_from_tensordict'".
    prefix = _case(tmp_path, "0.3.2", "tensorclass_in_td")
    target = tdckpt.load_memmap(prefix).clone()
    _edit(
        prefix / "tc" / "meta.json", lambda m: m.update(_type="<class 'tensordict._td.TensorDict'>")
    )
    err = _refused_untouched(prefix, target, "unknown-class")
    assert "not a tensorclass" in str(err)


@pytest.mark.parametrize(
    ("type_str", "says"),
    [
        ("<class 'fixture_types.Point'>", "not a tensorclass"),
        ("<class 'fixture_types.torch'>", "not a tensorclass"),
        ("<class 'fixture_types.NoSuchClass'>", "has no class NoSuchClass"),
        ("<class 'tensordict.tensorclass.NonTensorData.__init__'>", "not a tensorclass"),
    ],
)
def test_a_tensorclass_type_naming_a_non_tensorclass_is_refused(
    tmp_path: Path, type_str: str, says: str
) -> None:
    prefix = _case(tmp_path, "0.15.3", "tensorclass_in_td")
    target = tdckpt.load_memmap(prefix).clone()
    _edit(prefix / "tc" / "meta.json", lambda m: m.update(_type=type_str))
    assert says in str(_refused_untouched(prefix, target, "unknown-class"))


def test_a_tensorclass_field_the_class_does_not_declare_is_reported_by_validate(
    tmp_path: Path,
) -> None:
    # Before: validate said ok, and only the restore refused (RestoreError).
    prefix = _case(tmp_path, "0.15.3", "tensorclass_in_td")
    target = tdckpt.load_memmap(prefix).clone()
    _edit(prefix / "tc" / "meta.json", lambda m: m.update(_names=None))
    assert "_names" in str(_refused_untouched(prefix, target, "unknown-field"))


def test_a_tensorclass_whose_module_is_not_imported_still_validates(tmp_path: Path) -> None:
    # Validation cannot judge a class it cannot see; the restore asks to import it.
    prefix = _case(tmp_path, "0.15.3", "tensorclass_in_td")
    _edit(
        prefix / "tc" / "meta.json",
        lambda m: m.update(_type="<class 'not_imported_module_xyz.TC'>"),
    )
    assert tdckpt.validate(prefix).ok
    with pytest.raises(RestoreError, match="is not imported"):
        tdckpt.load_memmap(prefix)


def test_the_corpus_tensorclass_still_restores(tmp_path: Path) -> None:
    prefix = _case(tmp_path, "0.15.3", "tensorclass")
    assert tdckpt.validate(prefix).ok
    assert isinstance(tdckpt.load_memmap(prefix), fixture_types.FixtureTC)


# -- lazy stacks whose members are missing --------------------------------------------------


@pytest.mark.parametrize("removed", ["0", "1"])
def test_a_lazy_stack_with_a_missing_member_is_refused(tmp_path: Path, removed: str) -> None:
    # Found on 0.10.0-lazy_stack: "rm_dir 0". No member was found (members are read from
    # 0 upwards), validate said ok and the build raised "a lazy stack with no members".
    # Removing "1" silently loaded a stack of one member and dropped "2".
    prefix = _case(tmp_path, "0.15.3", "lazy_stack")
    target = tdckpt.load_memmap(prefix)
    shutil.rmtree(prefix / removed)
    err = _refused_untouched(prefix, target, "stack-mismatch")
    assert "member is missing" in str(err)


def test_a_lazy_stack_without_members_is_refused(tmp_path: Path) -> None:
    prefix = _case(tmp_path, "0.15.3", "lazy_stack")
    for member in ("0", "1", "2"):
        shutil.rmtree(prefix / member)
    assert "stack-mismatch" in [p.code for p in tdckpt.validate(prefix).errors]
    with pytest.raises(ValidationError):
        tdckpt.load_memmap(prefix)


# -- manifest checksums that verify cannot compute -------------------------------------------


@pytest.mark.parametrize(
    "checksum", ["md4:00", "shake_128:00", "sm3:00", "crc32c:00", "crc32:0", "sha256:00"]
)
def test_a_checksum_verify_cannot_compute_is_refused_by_the_schema(checksum: str) -> None:
    # The schema's pattern accepted any "<word>:<hex>"; verify then raised
    # "ValueError: unknown checksum algorithm 'md4'". A digest of the wrong length can
    # never match either.
    with pytest.raises(ValueError):
        FileRecord(path="a.memmap", size=0, checksum=checksum)


def test_the_checksums_tdckpt_writes_fit_the_schema() -> None:
    for checksum in (
        "crc32:352441c2",
        "sha256:" + "0" * 64,
        "md5:" + "0" * 32,
        "blake2b:" + "0" * 128,
    ):
        assert FileRecord(path="a", size=0, checksum=checksum).checksum == checksum


def _manager_step(tmp_path: Path, checksum: str) -> tuple[Path, Path]:
    root = tmp_path / "run"
    td = TensorDict(a=torch.arange(6.0).reshape(3, 2), batch_size=[3])
    with CheckpointManager(root, fsync=False) as mgr:
        mgr.save(1, td)
    manifest = root / "1" / "tdckpt.manifest.json"
    doc = json.loads(manifest.read_text())
    record = next(r for r in doc["files"] if r["path"] == "a.memmap")
    record["checksum"] = checksum
    manifest.write_text(json.dumps(doc))
    return root, root / "1"


def test_verify_reports_a_manifest_with_an_algorithm_it_cannot_compute(tmp_path: Path) -> None:
    # Found by the manager fuzzer: step 1, checksum of a.memmap = "md4:0" ->
    # ValueError from CheckpointManager.verify.
    root, step_dir = _manager_step(tmp_path, "md4:0")
    before = tree_digest(root)
    with CheckpointManager(root) as mgr:
        report = mgr.verify(1)
        assert not report.ok
        assert [p.kind for p in report.problems] == ["manifest"]
        target = TensorDict(a=torch.zeros(3, 2), batch_size=[3])
        a = target["a"]
        with pytest.raises(TdckptError):
            mgr.restore_into(target, 1, verify=True)
        assert target["a"] is a
    assert "bad-manifest" in [p.code for p in tdckpt.validate(step_dir).errors]
    assert tree_digest(root) == before


def test_verify_still_checks_a_valid_sha256_manifest(tmp_path: Path) -> None:
    root, _ = _manager_step(tmp_path, "sha256:" + "0" * 64)
    with CheckpointManager(root) as mgr:
        report = mgr.verify(1)
    assert [(p.path, p.kind) for p in report.problems] == [("a.memmap", "changed")]


# -- lazy stacks whose members are not TensorDicts -------------------------------------------


@pytest.mark.parametrize(
    ("donor_case", "donor_rel", "says"),
    [
        # RuntimeError('devices differ, got cpu and None') from LazyStackedTensorDict.
        ("non_tensor_json", "s", "found a NonTensor"),
        # Built a "stack" of a TensorDict [2] and a FixtureTC [3] without a word.
        ("tensorclass_in_td", "tc", "found a TensorClass"),
        # RuntimeError('batch sizes in tensordicts differs, ...'): a nested stack of [3, 2].
        ("lazy_stack", "", "different batch sizes"),
    ],
)
def test_a_lazy_stack_member_that_is_not_a_fitting_tensordict_is_refused(
    tmp_path: Path, donor_case: str, donor_rel: str, says: str
) -> None:
    # The fuzzer's "graft <level> -> 1" on 0.15.3-lazy_stack.
    prefix = _case(tmp_path, "0.15.3", "lazy_stack")
    donor = _case(tmp_path / "donor", "0.15.3", donor_case) / donor_rel
    target = tdckpt.load_memmap(prefix)
    shutil.rmtree(prefix / "1")
    shutil.copytree(donor, prefix / "1")
    assert says in str(_refused_untouched(prefix, target, "stack-mismatch"))


def test_a_lazy_stack_of_lazy_stacks_still_restores(tmp_path: Path) -> None:
    inner = [
        LazyStackedTensorDict(
            *(TensorDict(x=torch.full((2,), float(i + j))) for j in range(2)), stack_dim=0
        )
        for i in range(3)
    ]
    outer = LazyStackedTensorDict(*inner, stack_dim=0)
    outer.memmap(tmp_path / "ckpt")
    assert tdckpt.validate(tmp_path / "ckpt").ok
    out = tdckpt.load_memmap(tmp_path / "ckpt")
    assert out.batch_size == outer.batch_size
    assert torch.equal(out.tensordicts[2].tensordicts[1]["x"], torch.full((2,), 3.0))


# -- a tensorclass field stored twice --------------------------------------------------------


@pytest.mark.parametrize("field", ["obs", "label"])
def test_a_tensorclass_field_in_meta_json_and_in_its_tensordict_is_refused(
    tmp_path: Path, field: str
) -> None:
    # The fuzzer's "add tc/meta.json:[] obs": tensordict's _from_tensordict raised
    # "KeyError: 'obs is present in both tensor and non-tensor dicts.'"; in place, the
    # target's tensorclass ended up holding the field twice.
    prefix = _case(tmp_path, "0.15.3", "tensorclass_in_td")
    target = tdckpt.load_memmap(prefix).clone()
    _edit(prefix / "tc" / "meta.json", lambda m: m.update({field: 1}))
    assert "both in meta.json and in _tensordict" in str(
        _refused_untouched(prefix, target, "schema")
    )


def test_a_tensorclass_field_pickled_and_in_its_tensordict_is_refused(tmp_path: Path) -> None:
    # The same, through other.pickle: validation does not unpickle, so the restore refuses.
    prefix = _case(tmp_path, "0.15.3", "tensorclass_in_td")
    target = tdckpt.load_memmap(prefix).clone()
    (prefix / "tc" / "other.pickle").write_bytes(pickle.dumps({"obs": 1}))
    before = tree_digest(prefix)
    with pytest.raises(RestoreError, match="both as non-tensor data and in its _tensordict"):
        tdckpt.load_memmap(prefix, allow_pickle=True)
    state = _state(target)
    with pytest.raises(RestoreError, match="both as non-tensor data"):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert _state(target) == state
    assert tree_digest(prefix) == before


# -- the last line of defence: a constructor that fails after validation ---------------------


@tensorclass
class Checked:
    """A user tensorclass whose __post_init__ refuses some values (tensordict runs it on load)."""

    obs: torch.Tensor
    label: str

    def __post_init__(self) -> None:
        if self.label == "bad":
            raise ValueError("label may not be 'bad'")


def test_a_constructor_failing_after_validation_becomes_a_restore_error_naming_the_key(
    tmp_path: Path,
) -> None:
    td = TensorDict(c=Checked(obs=torch.zeros(3), label="ok", batch_size=[3]), batch_size=[3])
    td.memmap(tmp_path / "ckpt")
    _edit(
        tmp_path / "ckpt" / "c" / "_tensordict" / "label" / "meta.json",
        lambda m: m.update(data="bad"),
    )
    assert tdckpt.validate(tmp_path / "ckpt").ok  # only the class knows
    with pytest.raises(
        RestoreError,
        match=r"'c' passed validation but cannot be rebuilt \(ValueError: label may not be 'bad'\)",
    ) as info:
        tdckpt.load_memmap(tmp_path / "ckpt")
    assert info.value.key == ("c",)
    target = TensorDict(c=Checked(obs=torch.ones(3), label="x", batch_size=[3]), batch_size=[3])
    del target["c"]  # a new value is built for a key the target lacks
    target["other"] = torch.ones(3)
    state = _state(target)
    with pytest.raises(RestoreError, match="cannot be rebuilt"):
        tdckpt.load_memmap_(target, tmp_path / "ckpt")
    assert _state(target) == state
