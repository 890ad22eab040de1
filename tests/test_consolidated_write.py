"""Saving in the consolidated layout: ``tdckpt.save(..., layout="consolidated")`` and
``CheckpointManager(..., layout="consolidated")`` - one data file per step that plain
``TensorDict.from_consolidated`` loads, per-leaf checksums in the manifest."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, TensorDict

import tdckpt
from tdckpt._read.consolidated import DATA_NAME
from tdckpt.errors import (
    CheckpointExistsError,
    UnsafePathError,
    UnsupportedContentError,
    ValidationError,
)
from tdckpt.schema import MANIFEST_NAME, Manifest


def make_td(shift: float = 0.0) -> TensorDict:
    return TensorDict(
        {
            "w": torch.arange(6.0).reshape(2, 3) + shift,
            "i": torch.tensor([1, 2], dtype=torch.int16),
            "odd key": torch.tensor([True, False]),
            "nested": {"b": torch.full((2, 2), 7.0 + shift, dtype=torch.float64)},
            "note": NonTensorData("hello", batch_size=[2]),
        },
        batch_size=[2],
    )


def leaves(td: Any) -> dict[Any, torch.Tensor]:
    return {k: v for k, v in td.items(True, True) if isinstance(v, torch.Tensor)}


def assert_same(a: Any, b: Any) -> None:
    la, lb = leaves(a), leaves(b)
    assert sorted(map(str, la)) == sorted(map(str, lb))
    for k, v in lb.items():
        assert torch.equal(la[k], v), k


def test_save_writes_one_data_file_and_the_manifest(tmp_path: Path) -> None:
    td = make_td()
    manifest = tdckpt.save(td, tmp_path / "ckpt", layout="consolidated")
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted([DATA_NAME, MANIFEST_NAME])
    theirs = TensorDict.from_consolidated(tmp_path / "ckpt" / DATA_NAME)
    assert_same(theirs, td)
    assert theirs["note"] == "hello"
    ours = tdckpt.load_memmap(tmp_path / "ckpt", allow_pickle=False)
    assert_same(ours, td)
    assert ours["note"] == "hello"
    on_disk = Manifest.model_validate_json((tmp_path / "ckpt" / MANIFEST_NAME).read_bytes())
    assert on_disk == manifest
    assert [f.path for f in manifest.files] == [DATA_NAME]
    assert manifest.consolidated is not None and manifest.consolidated.file == DATA_NAME
    data = (tmp_path / "ckpt" / DATA_NAME).read_bytes()
    by_key = {tuple(r.key): r for r in manifest.consolidated.leaves}
    assert set(by_key) == {("w",), ("i",), ("odd key",), ("nested", "b")}
    for key, record in by_key.items():
        raw = data[record.offset : record.offset + record.size]
        assert raw == td.get(key).contiguous().view(torch.uint8).flatten().numpy().tobytes()
        assert record.checksum == f"crc32:{zlib.crc32(raw):08x}"
    assert manifest.files[0].checksum == f"crc32:{zlib.crc32(data):08x}"


def test_save_in_place_restore_and_overwrite(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    tdckpt.save(make_td(), prefix, layout="consolidated")
    with pytest.raises(CheckpointExistsError):
        tdckpt.save(make_td(1.0), prefix, layout="consolidated")
    tdckpt.save(make_td(1.0), prefix, layout="consolidated", overwrite=True)
    target = make_td(-5.0)
    tdckpt.load_memmap_(target, prefix, allow_pickle=False)
    assert_same(target, make_td(1.0))


def test_bad_layout_and_archive_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layout must be one of"):
        tdckpt.save(make_td(), tmp_path / "x", layout="zip")
    with pytest.raises(ValueError, match=r"not a \.tdz archive"):
        tdckpt.save(make_td(), tmp_path / "x.tdz", layout="consolidated")
    assert not any(tmp_path.iterdir())


def test_content_tensordict_cannot_consolidate_is_refused_and_nothing_left(
    tmp_path: Path,
) -> None:
    td = TensorDict(a=torch.ones(2), obj=NonTensorData(object()), batch_size=[])
    with pytest.raises(UnsupportedContentError, match="layout='memmap'"):
        tdckpt.save(td, tmp_path / "ckpt", layout="consolidated")
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("how", ["save", "manager", "save_async", "tensorclass"])
def test_a_dtype_consolidate_cannot_name_is_refused_naming_the_key(
    tmp_path: Path, how: str
) -> None:
    """tensordict's consolidate() has no name for float8 dtypes: refused before anything
    is written, naming the key and the layout that stores it (was a raw KeyError from
    inside tensordict, or an AttributeError from save_async)."""
    from tensordict import tensorclass

    f8 = torch.randn(3).to(torch.float8_e4m3fn)
    td = TensorDict(ok=torch.ones(3), sub=TensorDict(w=f8))
    match = r"cannot store 'sub\.w' \(torch\.float8_e4m3fn\).*layout='memmap'"
    if how == "save":
        with pytest.raises(UnsupportedContentError, match=match) as info:
            tdckpt.save(td, tmp_path / "ckpt", layout="consolidated")
        assert str(tmp_path / "ckpt") in str(info.value)
    elif how == "tensorclass":

        @tensorclass
        class Pair:
            w: torch.Tensor

        with pytest.raises(UnsupportedContentError, match=r"cannot store 'w'"):
            tdckpt.save(Pair(w=f8, batch_size=[3]), tmp_path / "ckpt", layout="consolidated")
    else:
        with tdckpt.CheckpointManager(tmp_path / "run", layout="consolidated") as mgr:
            with pytest.raises(UnsupportedContentError, match=match):
                if how == "save_async":
                    mgr.save_async(1, td).result()
                else:
                    mgr.save(1, td)
            assert mgr.steps() == []
        root = tmp_path / "run"
        assert set(os.listdir(root) if root.exists() else []) <= {".tdckpt.lock"}
        if root.exists():
            (root / ".tdckpt.lock").unlink(missing_ok=True)
            root.rmdir()
    assert sorted(os.listdir(tmp_path)) == []
    tdckpt.save(td, tmp_path / "memmap")  # the per-leaf layout stores it
    assert (
        tdckpt.load_memmap(tmp_path / "memmap")["sub", "w"]
        .view(torch.uint8)
        .equal(f8.view(torch.uint8))
    )


def test_a_symlinked_data_file_is_refused(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    tdckpt.save(make_td(), prefix, layout="consolidated")
    real = tmp_path / "elsewhere.bin"
    (prefix / DATA_NAME).rename(real)
    (prefix / DATA_NAME).symlink_to(real)
    with pytest.raises(UnsafePathError, match="symlink"):
        tdckpt.load_memmap(prefix, allow_pickle=False)


def test_manager_consolidated_steps(tmp_path: Path) -> None:
    mgr = tdckpt.CheckpointManager(tmp_path / "run", layout="consolidated", retention=None)
    mgr.save(1, make_td(), metadata={"loss": 1.0})
    mgr.save(2, make_td(2.0))
    assert mgr.steps() == [1, 2]
    assert sorted(os.listdir(mgr.path(2))) == sorted([DATA_NAME, MANIFEST_NAME])
    assert mgr.metadata(1) == {"loss": 1.0}
    target = make_td(-1.0)
    mgr.restore_into(target, allow_pickle=False)
    assert_same(target, make_td(2.0))
    assert_same(mgr.restore(step=1, allow_pickle=False), make_td())
    assert_same(TensorDict.from_consolidated(mgr.path(1) / DATA_NAME), make_td())
    report = mgr.verify(2)
    assert report.ok, report.summary()
    mgr.close()


def test_manager_verify_names_the_damaged_leaf(tmp_path: Path) -> None:
    mgr = tdckpt.CheckpointManager(tmp_path / "run", layout="consolidated")
    manifest_path = mgr.save(1, make_td()) / MANIFEST_NAME
    record = next(
        r
        for r in Manifest.model_validate_json(manifest_path.read_bytes()).consolidated.leaves  # type: ignore[union-attr]
        if r.key == ["nested", "b"]
    )
    data = mgr.path(1) / DATA_NAME
    raw = bytearray(data.read_bytes())
    raw[record.offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    report = mgr.verify(1)
    changed = [(p.path, p.key) for p in report.problems if p.kind == "changed"]
    # the whole file, then the one leaf whose bytes changed, by its key
    assert changed == [(DATA_NAME, ()), (DATA_NAME, ("nested", "b"))]
    mgr.close()


def test_manager_refuses_what_the_layout_cannot_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not with archive=True"):
        tdckpt.CheckpointManager(tmp_path / "a", layout="consolidated", archive=True)
    with pytest.raises(ValueError, match="layout must be one of"):
        tdckpt.CheckpointManager(tmp_path / "b", layout="other")


def test_manifest_json_is_plain(tmp_path: Path) -> None:
    tdckpt.save(make_td(), tmp_path / "ckpt", layout="consolidated")
    raw = json.loads((tmp_path / "ckpt" / MANIFEST_NAME).read_text())
    assert raw["consolidated"]["file"] == DATA_NAME
    assert all(
        set(r) == {"key", "offset", "size", "checksum"} for r in raw["consolidated"]["leaves"]
    )


def test_manager_training_state(tmp_path: Path) -> None:
    """A training state (module + optimizer) saved and restored through one data file."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    mgr = tdckpt.CheckpointManager(tmp_path / "run", layout="consolidated")
    path = mgr.save(1, {"model": model, "optim": opt})
    assert sorted(os.listdir(path)) == sorted([DATA_NAME, MANIFEST_NAME])
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(model2.parameters())
    mgr.restore_into({"model": model2, "optim": opt2}, allow_pickle=False)
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(
        opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    mgr.close()


def test_inspect_and_validate_a_step_folder(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    tdckpt.save(make_td(), prefix, layout="consolidated")
    info = tdckpt.inspect(prefix)
    assert info.storage == "consolidated"
    assert info.leaf_count == 4
    assert tdckpt.validate(prefix).ok


def test_inspect_shows_the_manifest_and_validate_checks_it(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    manifest = tdckpt.save(make_td(), prefix, layout="consolidated", metadata={"loss": 0.5})
    info = tdckpt.inspect(prefix)
    assert info.manifest is not None
    assert info.manifest["user_metadata"] == {"loss": 0.5}
    assert (
        info.manifest["consolidated"]["leaves"]
        == manifest.model_dump(mode="json")["consolidated"]["leaves"]
    )
    (prefix / MANIFEST_NAME).write_text('{"schema_version": "x"}')
    report = tdckpt.validate(prefix)
    assert [p.code for p in report.problems] == ["bad-manifest"]
    # as for a folder of the memmap layout, a damaged manifest refuses the restore
    with pytest.raises(ValidationError, match="manifest schema"):
        tdckpt.load_memmap(prefix, allow_pickle=False)


def test_a_symlinked_manifest_is_not_read(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    tdckpt.save(make_td(), prefix, layout="consolidated")
    outside = tmp_path / "outside.json"
    (prefix / MANIFEST_NAME).rename(outside)
    (prefix / MANIFEST_NAME).symlink_to(outside)
    assert tdckpt.inspect(prefix).manifest is None
