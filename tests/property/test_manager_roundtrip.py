"""Property: whatever CheckpointManager saves, it restores - new object and in place.

Hypothesis builds TensorDicts (dtypes incl. bfloat16/complex/bool/uint, 0-d and
zero-element leaves, nesting, odd keys, non-tensor values), sometimes wrapped in a
tensorclass or a lazy stack; ``save`` then ``restore`` and ``restore_into`` must give the
same keys, classes, batch sizes, dtypes, shapes and values, and plain tensordict 0.15.3
must read the step identically.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tensordict = pytest.importorskip("tensordict")

from fixture_types import FixtureTC  # noqa: E402
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict  # noqa: E402

from tdckpt import CheckpointManager  # noqa: E402  # noqa: E402

EXAMPLES = int(os.environ.get("TDCKPT_HYPOTHESIS_EXAMPLES", "15"))
KEYS = ["a", "b c", "p%q", ".hidden", "ü", "..", "x/y", "meta.json", "other.pickle"]
DTYPES = [torch.float32, torch.bfloat16, torch.complex64, torch.bool, torch.uint8, torch.uint16, torch.int64]


@st.composite
def tds(draw: Any, batch: tuple[int, ...] = (2,), depth: int = 0) -> TensorDict:
    td = TensorDict(batch_size=batch)
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=4, unique=True)):
        kinds = ["leaf", "leaf", "text", "child"] if depth < 2 else ["leaf", "text"]
        if key == "meta.json":  # a collection named meta.json cannot exist on disk
            kinds = ["leaf"]
        kind = draw(st.sampled_from(kinds))
        if kind == "child":
            td[key] = draw(tds(batch, depth + 1))
        elif kind == "text":
            td.set_non_tensor(key, draw(st.one_of(st.text(max_size=4), st.integers(-5, 5))))
        else:
            extra = draw(st.lists(st.integers(0, 3), max_size=2))
            shape = (*batch, *extra)
            dtype = draw(st.sampled_from(DTYPES))
            n = torch.Size(shape).numel()
            td[key] = (torch.arange(n) % 5).to(dtype).reshape(shape)
    return td


@st.composite
def saved_objects(draw: Any) -> Any:
    kind = draw(st.sampled_from(["td", "td", "tensorclass", "lazy"]))
    if kind == "tensorclass":
        inner = draw(tds())
        return FixtureTC(
            obs=torch.arange(4.0).reshape(2, 2),
            reward=torch.ones(2),
            label=draw(st.text(max_size=3)),
            extra={"k": draw(st.integers(0, 9))},
            batch_size=[2],
        ), inner
    if kind == "lazy":
        members = [TensorDict(x=torch.full((2, i + 1), float(i)), batch_size=[2]) for i in range(3)]
        return LazyStackedTensorDict(*members, stack_dim=0), None
    return draw(tds()), None


def _same(a: Any, b: Any, where: str = "<root>") -> None:
    if isinstance(a, torch.Tensor):  # a MemoryMappedTensor or a plain view of an archive
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point or a.is_complex() else a,
                           b.view(torch.uint8) if b.dtype.is_floating_point or b.is_complex() else b), where
        return
    assert type(a).__name__ == type(b).__name__, where
    if isinstance(a, NonTensorData):
        assert a.data == b.data, where
        return
    if isinstance(a, LazyStackedTensorDict):
        assert len(a.tensordicts) == len(b.tensordicts) and a.stack_dim == b.stack_dim, where
        for i, (x, y) in enumerate(zip(a.tensordicts, b.tensordicts)):
            _same(x, y, f"{where}[{i}]")
        return
    if hasattr(a, "_tensordict") and not isinstance(a, TensorDict):  # tensorclass
        assert a.label == b.label and a.extra == b.extra, where
        _same(a._tensordict, b._tensordict, where)
        return
    assert a.batch_size == b.batch_size, where
    assert set(a.keys()) == set(b.keys()), where
    for key in a.keys():
        _same(a._tensordict[key], b._tensordict[key], f"{where}.{key}")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=saved_objects(), archive=st.booleans())
def test_save_then_restore_gives_it_back(case: Any, archive: bool) -> None:
    obj, _ = case
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        with CheckpointManager(root, archive=archive, fsync=False) as mgr:
            path = mgr.save(1, obj, metadata={"loss": 1.0})
            _same(mgr.restore(1, allow_pickle=False), obj)
            # plain tensordict reads the step identically
            _same(TensorDict.load_memmap(path, allow_pickle=False), obj)
            if isinstance(obj, TensorDict):
                target = obj.clone()
                mgr.restore_into(target, allow_pickle=False)  # strict: same keys
                _same(target, obj)
                target["stale"] = torch.zeros(2)
                mgr.restore_into(target, allow_pickle=False, strict=False)  # stale key removed
                _same(target, obj)
