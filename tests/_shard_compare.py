"""Exact comparison of restored objects with a reference (sharded tests and their children)."""

from __future__ import annotations

from typing import Any

import torch


def _leaves(obj: Any) -> dict[tuple[str, ...], Any]:
    from tensordict.base import _is_leaf_nontensor

    out = {}
    for key, value in obj.items(True, True, is_leaf=_is_leaf_nontensor):
        out[key if isinstance(key, tuple) else (key,)] = value
    return out


def _plain(value: Any) -> Any:
    from tensordict import NonTensorData, NonTensorStack

    if isinstance(value, NonTensorStack):
        return list(value.tolist())
    if isinstance(value, NonTensorData):
        return value.data
    return value


def assert_same(got: Any, want: Any, what: str) -> None:
    """Same class, batch size, keys, dtypes and bit-exact values (non-tensor data by value)."""
    assert type(got).__name__ == type(want).__name__, f"{what}: {type(got)} != {type(want)}"
    assert got.batch_size == want.batch_size, f"{what}: {got.batch_size} != {want.batch_size}"
    g, w = _leaves(got), _leaves(want)
    assert set(g) == set(w), f"{what}: keys {sorted(g)} != {sorted(w)}"
    for key, value in w.items():
        other = g[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor), f"{what}: {key} is {type(other)}"
            assert other.dtype == value.dtype and other.shape == value.shape, (what, key)
            assert torch.equal(
                other.view(torch.uint8) if other.dtype == torch.bool else other,
                value.view(torch.uint8) if value.dtype == torch.bool else value,
            ), f"{what}: {key} differs"
        else:
            a, b = _plain(other), _plain(value)
            if isinstance(b, list) and not isinstance(a, list):
                a = [a] * len(b)
            if isinstance(a, list) and not isinstance(b, list):
                b = [b] * len(a)
            assert a == b, f"{what}: {key}: {a!r} != {b!r}"
