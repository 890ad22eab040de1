"""Keys named like fields of other levels' metadata are ordinary keys of a TensorDict level."""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

import tdckpt


def test_keys_named_like_metadata_fields_restore(tmp_path: Path) -> None:
    td = TensorDict(
        {
            "index": torch.arange(3),
            "_metadata": torch.ones(3),
            "custom_op_kwargs": TensorDict(x=torch.zeros(3), batch_size=[3]),
            "data": torch.full((3,), 2.0),
        },
        batch_size=[3],
    )
    td.memmap(tmp_path / "ckpt")
    assert tdckpt.validate(tmp_path / "ckpt").ok
    for robust_key in (True, None):
        out = tdckpt.load_memmap(tmp_path / "ckpt", robust_key=robust_key)
        assert sorted(out.keys()) == ["_metadata", "custom_op_kwargs", "data", "index"]
        assert out["index"].tolist() == [0, 1, 2]
        assert out["custom_op_kwargs", "x"].tolist() == [0.0, 0.0, 0.0]


def test_keys_named_like_format_fields_restore(tmp_path: Path) -> None:
    # tensordict keeps such a key's entry and then writes no _format_version / _class /
    # _names field: the level "reads as version 0", as tensordict 0.15.3 itself loads it.
    td = TensorDict(
        {"_format_version": torch.ones(2), "_class": torch.zeros(2), "_names": torch.arange(2)},
        batch_size=[2],
    )
    td.memmap(tmp_path / "ckpt")
    assert tdckpt.validate(tmp_path / "ckpt").ok
    out = tdckpt.load_memmap(tmp_path / "ckpt")
    reference = TensorDict.load_memmap(tmp_path / "ckpt")
    assert sorted(out.keys()) == sorted(reference.keys()) == ["_class", "_format_version", "_names"]
    for key in out.keys():  # noqa: SIM118 - iterating a TensorDict walks its batch dimension, not its keys
        assert torch.equal(out[key], reference[key])
