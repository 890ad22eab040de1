"""Tensorclass checkpoints whose saved fields the class does not declare.

Where the class is imported, validation reports such fields (``unknown-field``), so the
restore refuses with a ValidationError before anything is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import copy_case, tree_digest
from fixture_types import FixtureTC

import tdckpt
from tdckpt.errors import ValidationError


def _with_extra_field(tmp_path: Path) -> Path:
    prefix = copy_case(tmp_path, "0.15.3", "tensorclass")
    meta = json.loads((prefix / "meta.json").read_text())
    meta["renamed_field"] = 1
    (prefix / "meta.json").write_text(json.dumps(meta))
    return prefix


def test_load_memmap_refuses_undeclared_fields(tmp_path: Path) -> None:
    prefix = _with_extra_field(tmp_path)
    assert [p.code for p in tdckpt.validate(prefix).errors] == ["unknown-field"]
    with pytest.raises(ValidationError, match=r"renamed_field.*does not declare"):
        tdckpt.load_memmap(prefix)


def test_load_memmap__refuses_undeclared_fields_and_keeps_the_target(tmp_path: Path) -> None:
    prefix = _with_extra_field(tmp_path)
    before = tree_digest(prefix)
    target = FixtureTC(
        obs=torch.zeros(3, 2), reward=torch.zeros(3), label="x", extra=None, batch_size=[3]
    )
    obs, non_tensor = target.obs, dict(target._non_tensordict)
    with pytest.raises(ValidationError, match="renamed_field"):
        tdckpt.load_memmap_(target, prefix)
    assert target.obs is obs
    assert dict(target._non_tensordict) == non_tensor
    assert tree_digest(prefix) == before
