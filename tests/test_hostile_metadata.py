"""Metadata that parses as JSON and fits the schema's types, but cannot be restored faithfully.

Each is reported by ``validate`` (or refused by the restore with a clear error) before
anything is touched - never a RecursionError or an inconsistent tensordict.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tree_digest
from tensordict import NonTensorStack, TensorDict

import tdckpt
from tdckpt.errors import RestoreError, ValidationError


def _nest(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    td = TensorDict(a=torch.zeros(2), batch_size=[2])
    td["s"] = NonTensorStack("x", "y")
    td.memmap(tmp_path / "ckpt")
    return tmp_path / "ckpt"


CASES: dict[str, tuple[str, Callable[[dict[str, Any]], None], str]] = {
    "stack-nested-900-deep": (
        "s/meta.json",
        lambda m: m.update(data=[_nest(900, "z")] * 2),
        "bad-shape",
    ),
    "stack-longer-than-batch": (
        "s/meta.json",
        lambda m: m.update(data=["a", "b", "c"]),
        "batch-mismatch",
    ),
    "unknown-level-device": ("meta.json", lambda m: m.update(device="quantum:7"), "bad-device"),
    "unknown-stack-device": ("s/meta.json", lambda m: m.update(device="zz"), "bad-device"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reported_by_validate_and_refused_untouched(prefix: Path, case: str) -> None:
    rel, change, code = CASES[case]
    _edit(prefix / rel, change)
    before = tree_digest(prefix)
    report = tdckpt.validate(prefix)
    assert not report.ok
    assert [p.code for p in report.errors] == [code]
    target = TensorDict(a=torch.ones(2), batch_size=[2])
    a = target["a"]
    with pytest.raises(ValidationError) as info:
        tdckpt.load_memmap_(target, prefix)
    assert [p.code for p in info.value.report.errors] == [code]
    assert target["a"] is a and list(target.keys()) == ["a"]
    assert tree_digest(prefix) == before


def test_a_non_cpu_level_device_asks_for_an_explicit_device(prefix: Path) -> None:
    # tensordict 0.3.0/0.3.1 memmap_() could record cuda:0 above CPU files; tensordict
    # then builds a "cuda" tensordict of CPU tensors. tdckpt asks where to put the data.
    _edit(prefix / "meta.json", lambda m: m.update(device="cuda:0"))
    with pytest.raises(RestoreError, match="device='cpu'"):
        tdckpt.load_memmap(prefix)
    out = tdckpt.load_memmap(prefix, device="cpu")
    assert out.device == torch.device("cpu") and out["a"].device == torch.device("cpu")


def test_device_meta_gives_a_consistent_structure_only_tensordict(prefix: Path) -> None:
    out = tdckpt.load_memmap(prefix, device="meta")
    assert out.device == torch.device("meta")
    assert out["a"].is_meta and out["a"].shape == (2,)
