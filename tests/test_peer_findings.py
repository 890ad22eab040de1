"""What tensordict's own suite showed once its classmethod loader was routed through tdckpt.

tests/peer routes ``TensorDict.load_memmap`` (hence ``TensorDict.load`` and tensorclass
loaders) as well as ``load_memmap_``; each case here is a test of tensordict's suite that failed
only when routed, reduced to what tdckpt got wrong.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import tdckpt

pytestmark = pytest.mark.filterwarnings(
    "ignore:The legacy lazy mode:DeprecationWarning",
)


def _legacy_permuted(dims: tuple[int, ...]) -> Any:
    from tensordict import set_lazy_legacy

    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with set_lazy_legacy(True):
            return TensorDict(
                a=torch.randn(3, 1, 4, 2, 5, generator=g),
                c=torch.randint(10, (3, 1, 4, 2, 3), generator=g),
                batch_size=[3, 1, 4, 2],
            ).permute(*dims)


@pytest.mark.parametrize("dims", [(2, 0, 3, 1), (1, 2, 0, 3), (1, 0, 2, 3)])
def test_a_lazy_legacy_permute_loads_as_tensordict_loads_it(
    tmp_path: Path, dims: tuple[int, ...]
) -> None:
    """tensordict writes a permute's inverse as the forward dims (``inv_op_kwargs`` =
    ``custom_op_kwargs``) and derives the real inverse from them; tdckpt refused every
    permutation that is not its own inverse as "damaged" (test_methods.py permute_td)."""
    view = _legacy_permuted(dims)
    from tensordict._lazy import _PermutedTensorDict

    assert type(view) is _PermutedTensorDict
    view.memmap(tmp_path / "ck")
    theirs = TensorDict.load_memmap(tmp_path / "ck")
    assert tdckpt.validate(tmp_path / "ck").ok
    ours = tdckpt.load_memmap(tmp_path / "ck", allow_pickle=False)
    assert type(ours) is type(theirs) is _PermutedTensorDict
    assert ours.batch_size == theirs.batch_size == view.batch_size
    assert ours.inv_op_kwargs == theirs.inv_op_kwargs
    assert ours.custom_op_kwargs == theirs.custom_op_kwargs
    for key in ("a", "c"):
        assert torch.equal(ours[key], view[key]) and torch.equal(ours[key], theirs[key])
    # the inverse undoes the view: its source is the saved source
    assert torch.equal(ours._source["a"], view._source["a"])
    assert torch.equal(ours._source["a"], theirs._source["a"])


def test_a_permute_whose_inverse_is_not_a_permutation_is_still_refused(tmp_path: Path) -> None:
    import json

    view = _legacy_permuted((2, 0, 3, 1))
    view.memmap(tmp_path / "ck")
    meta_path = tmp_path / "ck" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["inv_op_kwargs"] = {"dims": [0, 0, 1, 2]}
    meta_path.write_text(json.dumps(meta))
    report = tdckpt.validate(tmp_path / "ck")
    assert not report.ok
    assert any("inverse permute" in str(p) for p in report.problems), report


#: tensordict's test/artifacts/mmap_example, byte for byte (a pre-0.15.3 writer): the tree of
#: ``TensorDict({"nested": {"int64": [[1], [2]], "string": ["a string!"], "bfloat16":
#: torch.ones(2, 1, dtype=torch.bfloat16)}}, batch_size=[2, 1]).memmap(...)``.
MMAP_EXAMPLE = {
    "meta.json": b'{"nested": {"type": "TensorDict"}, "shape": [2, 1], "device": "cpu", '
    b'"_type": "<class \'tensordict._td.TensorDict\'>"}\n',
    "nested/meta.json": b'{"int64": {"device": "cpu", "shape": [2, 1], "dtype": "torch.int64", '
    b'"is_nested": false}, "string": {"type": "NonTensorData"}, "bfloat16": {"device": "cpu", '
    b'"shape": [2, 1], "dtype": "torch.bfloat16", "is_nested": false}, "shape": [2, 1], '
    b'"device": "cpu", "_type": "<class \'tensordict._td.TensorDict\'>"}\n',
    "nested/string/meta.json": b'{"_type": "<class \'tensordict.tensorclass.NonTensorData\'>", '
    b'"data": ["a string!"], "_metadata": null}\n',
    "nested/int64.memmap": bytes.fromhex("0100000000000000020000000000000000"),
    "nested/bfloat16.memmap": bytes.fromhex("803f803f0a00"),
}


def _mmap_example(prefix: Path) -> Path:
    for rel, data in MMAP_EXAMPLE.items():
        (prefix / rel).parent.mkdir(parents=True, exist_ok=True)
        (prefix / rel).write_bytes(data)
    return prefix


def test_tensordicts_mmap_example_artifact_loads_without_a_warning(tmp_path: Path) -> None:
    """test_generic.py::TestGeneric::test_load_custom_artifact under warnings-as-errors: a
    list-valued NonTensorData of a pre-0.15.3 writer warned "a tuple restores as a list" on
    every restore, though tensordict 0.15.3 writes and loads tuples as lists itself."""
    prefix = _mmap_example(tmp_path / "mmap_example")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        td = tdckpt.load_memmap(prefix, allow_pickle=False)
        nested = tdckpt.load_memmap(prefix / "nested", allow_pickle=False)
        target = TensorDict(nested=TensorDict(int64=torch.zeros(2, 1)), batch_size=[2, 1])
        tdckpt.load_memmap_(target, prefix, allow_pickle=False)
    assert td.shape == (2, 1)
    assert td["nested", "int64"].tolist() == [[1], [2]]
    assert td["nested", "int64"].dtype == torch.int64
    assert td["nested", "string"] == ["a string!"]
    assert td["nested", "bfloat16"].tolist() == [[1.0], [1.0]]
    assert td["nested", "bfloat16"].dtype == torch.bfloat16
    assert (nested == td["nested"]).all()
    assert target["nested", "string"] == ["a string!"]
    # said where one looks before loading: validate / inspect, as an info
    report = tdckpt.validate(prefix)
    assert report.ok
    infos = [p for p in report.problems if p.code == "json-list"]
    assert [(p.severity, p.path) for p in infos] == [("info", "nested/string")]
    assert "if it was a tuple it restores as a list" in infos[0].message


def test_a_file_that_is_not_an_archive_is_refused_in_tensordicts_words(tmp_path: Path) -> None:
    """test_methods.py::TestMemmapArchive::test_archive_bad_file: a ValueError saying "not a
    memory-mapped tensordict" (tdckpt's MetadataError is one)."""
    bad = tmp_path / "bad.tdz"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="not a memory-mapped tensordict archive") as info:
        tdckpt.load_memmap(bad)
    assert isinstance(info.value, tdckpt.errors.MetadataError)
    assert "the file is truncated, damaged or not a zip file" in str(info.value)


@pytest.mark.parametrize("form", ["directory", "compressed archive"])
def test_a_load_under_fake_tensor_mode_gives_fake_tensors_and_reads_no_leaf(
    tmp_path: Path, form: str
) -> None:
    """test_methods.py::TestMemmapArchive::test_archive_compressed_metadata_only_load: under
    torch's FakeTensorMode tensordict returns FakeTensors without reading the leaves; tdckpt
    mapped (or inflated) them and torch's fake mode failed an assertion."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    td = TensorDict(a=torch.randn(10), n=TensorDict(b=torch.arange(4)), batch_size=[])
    if form == "directory":
        prefix = tmp_path / "ck"
        td.memmap(prefix)
    else:
        prefix = tmp_path / "ck.tdz"
        td.save(prefix, compression="deflate")
    with FakeTensorMode():
        fake = tdckpt.load_memmap(prefix, allow_pickle=False)
        target = TensorDict(a=torch.zeros(10), n=TensorDict(b=torch.zeros(4, dtype=torch.int64)))
        assert tdckpt.load_memmap_(target, prefix, allow_pickle=False) is target
    for out in (fake, target):
        assert isinstance(out["a"], FakeTensor) and out["a"].shape == (10,)
        assert isinstance(out["n", "b"], FakeTensor) and out["n", "b"].dtype == torch.int64
    # outside the mode, the real values again
    assert torch.equal(tdckpt.load_memmap(prefix)["n", "b"], torch.arange(4))
