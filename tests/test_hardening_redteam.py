"""Red-team inputs found after the hardening merge: each one crashed or misbehaved before.

Every case builds a real checkpoint on disk, damages or races it the way an attacker or an
unlucky user would, and asserts a clear TdckptError (or a clean report) and no other effect.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tdckpt import CheckpointManager
from tdckpt.errors import IncompleteCheckpointError
from tdckpt.schema import MANIFEST_NAME


def _td() -> TensorDict:
    return TensorDict(
        {"a": torch.arange(6.0).reshape(2, 3), "n": {"b": torch.ones(2, dtype=torch.int64)}},
        batch_size=[2],
    )


def _patch_entry(path: Path, name: str, *, flags: int = 0, method: int | None = None) -> None:
    """Set general-purpose flag bits and/or the method of entry ``name``, in both headers."""
    data = bytearray(path.read_bytes())
    for sig, flag_at, method_at, name_len_at, name_at in (
        (b"PK\x01\x02", 8, 10, 28, 46),
        (b"PK\x03\x04", 6, 8, 26, 30),
    ):
        i = 0
        while (i := data.find(sig, i)) >= 0:
            (n,) = struct.unpack_from("<H", data, i + name_len_at)
            if data[i + name_at : i + name_at + n].decode() == name:
                (old,) = struct.unpack_from("<H", data, i + flag_at)
                struct.pack_into("<H", data, i + flag_at, old | flags)
                if method is not None:
                    struct.pack_into("<H", data, i + method_at, method)
            i += 4
    path.write_bytes(bytes(data))


# -- step archives whose zip entries zipfile refuses with odd exception types -----------------

_DAMAGE = {
    "encrypted": {"flags": 1},
    "unknown-method": {"method": 99},
    "bad-deflate": {"method": 8},
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_a_step_archive_with_an_unreadable_manifest_is_damaged_not_a_crash(
    tmp_path: Path, damage: str
) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, archive=True, fsync=False) as mgr:
        mgr.save(1, _td())
        bad = mgr.save(2, _td())
    _patch_entry(bad, MANIFEST_NAME, **_DAMAGE[damage])
    with CheckpointManager(root, archive=True, fsync=False) as mgr:
        assert mgr.steps() == [1]  # the damaged step is not committed; step 1 still is
        rows = {row.step: row for row in mgr.list_steps()}
        assert rows[2].status == "damaged"
        assert rows[2].detail is not None and "not a readable archive" in rows[2].detail
        with pytest.raises(IncompleteCheckpointError, match="step 2"):
            mgr.restore_into(_td().zero_(), step=2)
        out = _td().zero_()
        mgr.restore_into(out)  # the latest committed step
        assert torch.equal(out["a"], _td()["a"])


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_verify_reports_an_archive_leaf_zipfile_cannot_read(tmp_path: Path, damage: str) -> None:
    with CheckpointManager(tmp_path / "run", archive=True, fsync=False) as mgr:
        path = mgr.save(1, _td())
        _patch_entry(path, "a.memmap", **_DAMAGE[damage])
        report = mgr.verify(1)
    assert not report.ok
    assert [(p.path, p.key, p.kind) for p in report.problems] == [("a.memmap", ("a",), "changed")]
    assert "unreadable" in (report.problems[0].found or "")
