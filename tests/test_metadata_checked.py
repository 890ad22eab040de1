"""A managed step's metadata is compared with its manifest on every restore, not only verify=True.

A restore reads every ``meta.json`` whole anyway; each is checked against the checksum the
manifest recorded as it is read (``tdckpt._read.expected``), so a step tampered with after its
commit is refused by a plain ``restore()`` / ``restore_into()`` with an IntegrityError, and
the target is untouched.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, TensorDict

from tdckpt.errors import IntegrityError
from tdckpt.manager import CheckpointManager
from tdckpt.schema import MANIFEST_NAME


def make_td() -> TensorDict:
    return TensorDict(
        {
            "a": torch.arange(12, dtype=torch.float32).reshape(4, 3),
            "nested": TensorDict({"c": torch.ones(4, 2)}, batch_size=[4]),
            "s": NonTensorData("hello", batch_size=[4]),
        },
        batch_size=[4],
    )


@pytest.fixture
def mgr(tmp_path: Path) -> Any:
    with CheckpointManager(tmp_path / "root", fsync=False) as manager:
        yield manager


def _edit(path: Path, old: bytes, new: bytes) -> None:
    """Replace the first ``old`` in the file by ``new``."""
    raw = path.read_bytes()
    assert old in raw, raw
    os.chmod(path, 0o644)
    path.write_bytes(raw.replace(old, new, 1))


def _snapshot(td: TensorDict) -> dict[str, Any]:
    return {
        ".".join(k) if isinstance(k, tuple) else k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in td.items(include_nested=True, leaves_only=True)
    }


def test_a_tampered_meta_json_is_refused_by_a_plain_restore(mgr: CheckpointManager) -> None:
    """float32 -> float16 keeps the file large enough: without the manifest check the step
    restored silently as garbage halves."""
    path = mgr.save(1, make_td())
    _edit(path / "meta.json", b'"torch.float32"', b'"torch.float16"')
    with pytest.raises(IntegrityError, match=r"step 1: the file meta\.json has checksum") as info:
        mgr.restore(1, allow_pickle=False)
    assert "the manifest records crc32:" in str(info.value)
    assert "nothing was restored" in str(info.value) and "verify()" in str(info.value)
    assert info.value.path == str(path / "meta.json")  # type: ignore[attr-defined]
    target = make_td().apply(lambda t: t * 0)
    before = _snapshot(target)
    with pytest.raises(IntegrityError, match=r"meta\.json"):
        mgr.restore_into(target, 1, allow_pickle=False)
    after = _snapshot(target)
    assert before.keys() == after.keys()
    assert all(
        torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else True
        for k in before
    )
    assert not mgr.verify(1).ok  # what verify=True would have said


def test_a_nested_meta_json_and_a_non_tensor_one_are_checked_too(mgr: CheckpointManager) -> None:
    path = mgr.save(1, make_td())
    _edit(path / "nested" / "meta.json", b'"torch.float32"', b'"torch.float16"')
    with pytest.raises(IntegrityError, match=r"nested/meta\.json"):
        mgr.restore(1, allow_pickle=False)
    path = mgr.save(2, make_td())
    _edit(path / "s" / "meta.json", b'"hello"', b'"HELLO"')
    with pytest.raises(IntegrityError, match=r"s/meta\.json"):
        mgr.restore(2, allow_pickle=False)
    with pytest.raises(IntegrityError, match=r"s/meta\.json"):
        mgr.restore_into(make_td(), 2, allow_pickle=False)


def test_a_meta_json_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "root", fsync=False) as mgr:
        path = mgr.save(1, make_td())
    manifest = path / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    data["files"] = [f for f in data["files"] if f["path"] != "nested/meta.json"]
    os.chmod(manifest, 0o644)
    manifest.write_text(json.dumps(data))
    with (
        CheckpointManager(tmp_path / "root", fsync=False) as mgr,
        pytest.raises(IntegrityError, match=r"nested/meta\.json is not listed in the step"),
    ):
        mgr.restore(1, allow_pickle=False)


def test_a_meta_json_of_another_size_is_refused(mgr: CheckpointManager) -> None:
    path = mgr.save(1, make_td())
    raw = (path / "meta.json").read_bytes()
    os.chmod(path / "meta.json", 0o644)
    (path / "meta.json").write_bytes(raw + b"\n")
    with pytest.raises(IntegrityError, match=r"meta\.json has \d+ bytes; the manifest records"):
        mgr.restore(1, allow_pickle=False)


def test_an_untouched_step_restores_and_a_restored_step_after_tampering_elsewhere(
    mgr: CheckpointManager,
) -> None:
    """Only the tampered step is refused; the check does not leak to other reads."""
    mgr.save(1, make_td())
    path2 = mgr.save(2, make_td())
    _edit(path2 / "meta.json", b'"torch.float32"', b'"torch.float16"')
    out = mgr.restore(1, allow_pickle=False)
    assert torch.equal(out["a"], make_td()["a"])
    with pytest.raises(IntegrityError):
        mgr.restore(2, allow_pickle=False)
    # after the refused restore, nothing is left declared: a plain load of the step reads it
    import tdckpt

    assert tdckpt.load_memmap(path2, allow_pickle=False)["a"].dtype == torch.float16


def test_a_training_state_restore_checks_its_metadata(mgr: CheckpointManager) -> None:
    model = torch.nn.Linear(3, 2)
    path = mgr.save(1, {"model": model})
    metas = sorted(path.rglob("meta.json"))
    target = next(m for m in metas if b'"torch.float32"' in m.read_bytes())
    _edit(target, b'"torch.float32"', b'"torch.float16"')
    fresh = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(IntegrityError, match=r"meta\.json"):
        mgr.restore_into({"model": fresh})
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def _rewrite_zip_entry(archive: Path, name: str, old: bytes, new: bytes) -> None:
    """Change a stored entry in place (same length) and fix its CRC-32 in both headers."""
    assert len(old) == len(new)
    with zipfile.ZipFile(archive) as zf:
        info = zf.getinfo(name)
        data = zf.read(name)
    assert info.compress_type == zipfile.ZIP_STORED and data.count(old) == 1
    changed = data.replace(old, new)
    raw = bytearray(archive.read_bytes())
    at = raw.find(data)
    assert at >= 0
    raw[at : at + len(data)] = changed
    old_crc, new_crc = struct.pack("<I", info.CRC), struct.pack("<I", zlib.crc32(changed))
    assert raw.count(old_crc) == 2  # the local header and the central directory
    raw = bytearray(bytes(raw).replace(old_crc, new_crc))
    os.chmod(archive, 0o644)
    archive.write_bytes(bytes(raw))


def test_a_tampered_archive_step_is_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "root", fsync=False, archive=True) as mgr:
        path = mgr.save(1, make_td())
        assert path.is_file()
        _rewrite_zip_entry(path, "meta.json", b'"torch.float32"', b'"torch.float16"')
        with pytest.raises(IntegrityError, match=r"step 1: the file meta\.json has checksum"):
            mgr.restore(1, allow_pickle=False)


def test_a_plain_step_restored_by_rows_checks_its_metadata(mgr: CheckpointManager) -> None:
    path = mgr.save(1, make_td())
    assert mgr.restore(1, rows=slice(1, 3), allow_pickle=False)["a"].shape == (2, 3)
    _edit(path / "meta.json", b'"torch.float32"', b'"torch.float16"')
    with pytest.raises(IntegrityError, match=r"step 1: the file meta\.json has checksum"):
        mgr.restore(1, rows=slice(1, 3), allow_pickle=False)
