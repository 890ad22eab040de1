"""Property: whatever CheckpointManager saves, it restores - new object and in place.

Hypothesis builds TensorDicts (dtypes incl. bfloat16/complex/bool/uint, 0-d and
zero-element leaves, nesting, odd keys, non-tensor values), sometimes inside a tensorclass
or as the members of a lazy stack; every leaf holds its own drawn values (a seed per leaf,
mixed with its key path), so a leaf restored from another key's file is caught. ``save``
then ``restore`` and ``restore_into`` must give the same keys, classes, batch sizes,
dtypes, shapes and values, and plain tensordict 0.15.3 must read the step identically.

``restore_into`` loads into targets built separately from the saved object (never a clone
of it): the same structure with other values for ``strict=True``, and for ``strict=False``
a different key set - a stale key at every level, and a saved key missing at the top.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tensordict = pytest.importorskip("tensordict")

from fixture_types import FixtureTC  # noqa: E402
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict  # noqa: E402

from tdckpt import CheckpointManager  # noqa: E402

EXAMPLES = int(os.environ.get("TDCKPT_HYPOTHESIS_EXAMPLES", "15"))
KEYS = ["a", "b c", "p%q", ".hidden", "ü", "..", "x/y", "meta.json", "other.pickle"]
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.complex64,
    torch.bool,
    torch.uint8,
    torch.uint16,
    torch.int64,
]


STALE = "zz_stale"


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values of ``dtype`` spread over its range, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    high = {torch.uint8: 2**8, torch.uint16: 2**16}.get(dtype)
    if high is not None:
        return torch.randint(0, high, shape, generator=g).to(dtype)
    return torch.randint(-(2**62), 2**62, shape, generator=g).to(dtype)


def _leaf(
    draw: Any, shape: tuple[int, ...], path: str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    dtype = dtype if dtype is not None else draw(st.sampled_from(DTYPES))
    # The drawn seed, mixed with the key path: two leaves never share their values' stream.
    seed = draw(st.integers(0, 2**31 - 1)) ^ zlib.crc32(path.encode())
    return _values(shape, dtype, seed)


@st.composite
def tds(draw: Any, batch: tuple[int, ...] = (2,), depth: int = 0, path: str = "") -> TensorDict:
    td = TensorDict(batch_size=batch)
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=4, unique=True)):
        kinds = ["leaf", "leaf", "text", "child"] if depth < 2 else ["leaf", "text"]
        if key == "meta.json":  # a collection named meta.json cannot exist on disk
            kinds = ["leaf"]
        kind = draw(st.sampled_from(kinds))
        where = f"{path}/{key}"
        if kind == "child":
            td[key] = draw(tds(batch, depth + 1, where))
        elif kind == "text":
            td.set_non_tensor(key, draw(st.one_of(st.text(max_size=4), st.integers(-5, 5))))
        else:
            extra = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            td[key] = _leaf(draw, (*batch, *extra), where)
    return td


@st.composite
def saved_objects(draw: Any) -> Any:
    kind = draw(st.sampled_from(["td", "td", "tensorclass", "lazy"]))
    if kind == "tensorclass":
        return FixtureTC(
            obs=_leaf(draw, (2, draw(st.integers(0, 3))), "obs", torch.float32),
            reward=_leaf(draw, (2,), "reward", torch.float32),
            label=draw(st.text(max_size=3)),
            extra=draw(tds(path="extra")),  # a drawn TensorDict as the tensorclass's field
            batch_size=[2],
        )
    if kind == "lazy":
        count = draw(st.integers(1, 3))
        members = [draw(tds(path=f"member{i}")) for i in range(count)]
        return LazyStackedTensorDict(*members, stack_dim=draw(st.sampled_from([0, 1])))
    return draw(tds())


def _other(value: Any) -> Any:
    """A non-tensor value that differs from ``value``."""
    return f"old-{value!r}"


def _target(obj: Any, *, stale: bool, drop: str | None = None, seed: int = 1) -> Any:
    """A target built from scratch with obj's structure and other values (never a clone).

    ``stale`` adds a key the checkpoint lacks at every level; ``drop`` leaves one saved
    key out of the top level (the restore must add it).
    """
    if isinstance(obj, torch.Tensor):
        return _values(tuple(obj.shape), obj.dtype, seed)
    if isinstance(obj, NonTensorData):
        return NonTensorData(_other(obj.data), batch_size=obj.batch_size)
    if isinstance(obj, LazyStackedTensorDict):
        members = [
            _target(m, stale=stale, seed=seed + i + 1) for i, m in enumerate(obj.tensordicts)
        ]
        return LazyStackedTensorDict(*members, stack_dim=obj.stack_dim)
    if isinstance(obj, FixtureTC):
        inner = _target(obj._tensordict, stale=False, seed=seed)
        if stale:  # the extra field's TensorDict gets its stale keys (a field cannot be added)
            inner["extra"] = _target(obj._tensordict["extra"], stale=True, seed=seed + 1)
        return FixtureTC._from_tensordict(inner)
    td = TensorDict(batch_size=obj.batch_size)
    for i, (key, value) in enumerate(obj._tensordict.items()):
        if key != drop:
            td._set_str(
                key,
                _target(value, stale=stale, seed=seed + 7 * (i + 1)),
                validated=True,
                inplace=False,
                non_blocking=False,
            )
    if stale:
        td[STALE] = torch.zeros(obj.batch_size)
    return td


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if t.dtype.is_floating_point or t.is_complex() else flat


def _same(a: Any, b: Any, where: str = "<root>") -> None:
    if isinstance(a, torch.Tensor):  # a MemoryMappedTensor or a plain view of an archive
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        if a.numel():  # bytes, so that NaN == NaN and -0.0 != 0.0
            assert torch.equal(_bytes(a), _bytes(b)), where
        return
    assert type(a).__name__ == type(b).__name__, where
    if isinstance(a, NonTensorData):
        assert a.data == b.data, where
        return
    if isinstance(a, LazyStackedTensorDict):
        assert len(a.tensordicts) == len(b.tensordicts) and a.stack_dim == b.stack_dim, where
        for i, (x, y) in enumerate(zip(a.tensordicts, b.tensordicts, strict=True)):
            _same(x, y, f"{where}[{i}]")
        return
    if hasattr(a, "_tensordict") and not isinstance(a, TensorDict):  # tensorclass
        _same(a._tensordict, b._tensordict, where)  # its fields, non-tensor ones included
        return
    assert a.batch_size == b.batch_size, where
    assert set(a.keys()) == set(b.keys()), where
    for key in a.keys():  # noqa: SIM118 - iterating a tensorclass walks its batch dimension, not its keys
        _same(a._tensordict[key], b._tensordict[key], f"{where}.{key}")


def _collections(obj: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """id() of every nested TensorDict level by key path (those must be reused)."""
    if isinstance(obj, FixtureTC):
        return _collections(obj._tensordict, path)
    if isinstance(obj, LazyStackedTensorDict):
        out = {}
        for i, m in enumerate(obj.tensordicts):
            out.update(_collections(m, (*path, str(i))))
        return out
    out = {path: id(obj)}
    for key, value in obj._tensordict.items():
        if type(value) is TensorDict:
            out.update(_collections(value, (*path, key)))
    return out


def _restore_into(mgr: CheckpointManager, target: Any, obj: Any, *, strict: bool) -> None:
    before = _collections(target)
    with pytest.raises(AssertionError):
        _same(target, obj)  # the target really differs before the restore
    assert mgr.restore_into(target, allow_pickle=False, strict=strict) is target
    _same(target, obj)
    after = _collections(target)
    for path, ident in after.items():
        if path in before:
            assert before[path] == ident, f"{path}: a nested TensorDict was replaced, not reused"


def _differs(obj: Any) -> bool:
    """Whether a built target can differ from obj at all (not for an empty TensorDict)."""
    try:
        _same(_target(obj, stale=False), obj)
    except AssertionError:
        return True
    return False


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=saved_objects(), archive=st.booleans(), data=st.data())
def test_save_then_restore_gives_it_back(obj: Any, archive: bool, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        with CheckpointManager(root, archive=archive, fsync=False) as mgr:
            path = mgr.save(1, obj, metadata={"loss": 1.0})
            _same(mgr.restore(1, allow_pickle=False), obj)
            # plain tensordict reads the step identically
            _same(TensorDict.load_memmap(path, allow_pickle=False), obj)
            # strict: a target with the same keys, built separately, with other values
            same_keys = _target(obj, stale=False)
            if _differs(obj):
                _restore_into(mgr, same_keys, obj, strict=True)
            # not strict: stale keys at every level, and maybe a saved key missing
            keys = list(obj._tensordict.keys()) if isinstance(obj, TensorDict) else []
            drop = data.draw(st.sampled_from([None, *keys]), label="drop")
            _restore_into(mgr, _target(obj, stale=True, drop=drop), obj, strict=False)
