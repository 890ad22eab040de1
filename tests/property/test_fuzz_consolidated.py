"""Consolidated-file fuzzer: a mutated single-file checkpoint is restored whole or refused.

Real files written by the installed tensordict's ``td.consolidate(filename=...)`` (nested
levels of every common dtype, a level of like leaves that tdckpt restores as one strided
view, non-tensor data and stacks, a lazy stack, zero-element leaves) are copied and mutated:
a node of the metadata JSON replaced by a value of another JSON kind, an offset or size
moved by a few bytes or past the end, an entry deleted, duplicated or renamed, a key added;
or the footer's length changed, or the file cut short. For every mutant:

* ``tdckpt.validate`` returns a report, or raises a :class:`~tdckpt.errors.TdckptError`;
* ``tdckpt.load_memmap`` and ``tdckpt.load_memmap_`` (into a copy of the original data)
  either succeed or raise a ``TdckptError`` - never another exception type, never a crash
  (a leaf mapped past the end of the file would die of SIGBUS when read) - and a refused
  ``load_memmap_`` leaves its target exactly as it was;
* a file ``validate`` calls valid loads, and a file that loads is one ``validate`` calls
  valid; every leaf of what loads can be read to its last byte, and no two leaves share a
  byte;
* the file is never written.

The number of examples is ``--fuzz-examples=N`` (or ``TDCKPT_FUZZ_EXAMPLES``)::

    python -m pytest -p no:cacheprovider tests/property/test_fuzz_consolidated.py \\
        --fuzz-examples=3000
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import alarm, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("tensordict")

from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict

import tdckpt
from tdckpt.errors import TdckptError

#: A mutant whose checks take longer than this has hung.
WATCHDOG_S = 60


def _seeds() -> dict[str, Any]:
    """The data of each seed file (written by tensordict itself, in the fixture)."""
    torch.manual_seed(0)
    return {
        "nested": TensorDict(
            {
                "f32": torch.randn(3, 2),
                "i64": torch.tensor([1, -2, 3]),
                "f16": torch.randn(3).half(),
                "bool": torch.tensor([True, False, True]),
                "empty": torch.zeros(3, 0),
                "n": {
                    "u8": torch.tensor([7, 8, 9], dtype=torch.uint8),
                    "f64": torch.ones(3, 1).double(),
                },
            },
            batch_size=[3],
        ),
        # one level of like leaves: the parse records it as a run, restored as one view
        "run": TensorDict({f"k{i}": torch.full((4,), float(i)) for i in range(12)}, batch_size=[4]),
        "non-tensor": TensorDict(
            {
                "x": torch.ones(2),
                "text": NonTensorData("hello", batch_size=[2]),
                "cfg": NonTensorData({"lr": 0.1, "layers": [1, 2]}, batch_size=[2]),
                "words": NonTensorStack("a", "b"),
            },
            batch_size=[2],
        ),
        "lazy-stack": TensorDict(
            ls=LazyStackedTensorDict(
                TensorDict(a=torch.ones(3), n={"x": torch.full((1,), 2.0)}),
                TensorDict(a=torch.zeros(3), n={"x": torch.full((1,), 3.0)}),
                stack_dim=0,
            ),
            batch_size=[2],
        ),
    }


SEEDS = _seeds()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz-consolidated")
    out = {}
    for name, td in SEEDS.items():
        path = root / f"{name}.bin"
        td.consolidate(filename=path)
        out[name] = path
    return out


def split(raw: bytes) -> tuple[bytes, Any]:
    """A consolidated file's leaf bytes and parsed metadata."""
    (n,) = struct.unpack("<q", raw[-8:])
    return raw[: -8 - n], json.loads(raw[-8 - n : -8])


def join(data: bytes, meta: Any, length: int | None = None) -> bytes:
    blob = json.dumps(meta).encode()
    return data + blob + struct.pack("<q", len(blob) if length is None else length)


# -- mutations -------------------------------------------------------------------------------

_EDGE_INTS = [0, 1, -1, 7, 8, 9, 2**31, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30]
_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-4, 64),
    st.sampled_from(_EDGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from(["torch.float32", "torch.int64", "torch.bool", "float32", "", "TensorDict"]),
    st.text(max_size=4),
)
_json_any = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
_NEW_KEYS = [
    "cls",
    "leaves",
    "non_tensors",
    "cls_metadata",
    "batch_size",
    "device",
    "names",
    "stack_dim",
    "<NJT>x",
    "x",
    "",
    "..",
    "a/b",
]


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every node of the JSON document, with the keys and indices leading to it."""
    yield path, doc
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _nodes(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _nodes(value, (*path, i))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return doc


def _near(data: Any, value: int, data_size: int) -> int:
    """An integer near ``value``: a few bytes or an item off, at or past the end."""
    delta = data.draw(
        st.sampled_from([-9, -8, -4, -2, -1, 1, 2, 4, 8, 9, data_size, -value, 2**40]),
        label="delta",
    )
    return value + delta


def _is_leaf_spec(value: Any) -> bool:
    """A leaf entry as tensordict writes it: ``[dtype, shape, start, stop, pad]``."""
    return (
        isinstance(value, list)
        and len(value) == 5
        and isinstance(value[1], list)
        and all(type(v) is int for v in value[2:])
    )


def mutate(data: Any, raw: bytes) -> tuple[bytes, str]:
    """One mutant of the consolidated file ``raw`` and what was done."""
    leaves, meta = split(raw)
    how = data.draw(
        st.sampled_from(
            ["replace", "near", "shift", "delete", "duplicate", "add", "rename", "footer", "cut"]
        ),
        label="how",
    )
    if how == "footer":
        n = len(raw) - len(leaves) - 8
        length = data.draw(st.sampled_from([0, 1, n - 1, n + 1, len(raw), 2**62, -1]), label="len")
        return raw[:-8] + struct.pack("<q", length), f"footer length {n} -> {length}"
    if how == "cut":
        cut = data.draw(st.integers(1, len(raw) - 1), label="cut")
        return raw[:cut], f"cut to {cut} of {len(raw)} bytes"
    nodes = list(_nodes(meta))
    if how == "near":
        ints = [(p, v) for p, v in nodes if type(v) is int]
        path, value = data.draw(st.sampled_from(ints), label="int")
        new = _near(data, value, len(leaves))
        return join(leaves, _set(meta, path, new)), f"{path}: {value} -> {new}"
    if how == "shift":  # a leaf's bytes moved whole: its size still fits its shape
        specs = [(p, v) for p, v in nodes if _is_leaf_spec(v)]
        path, spec = data.draw(st.sampled_from(specs), label="leaf")
        delta = _near(data, 0, len(leaves))
        spec[2] += delta
        spec[3] += delta
        return join(leaves, meta), f"{path}: moved by {delta} bytes"
    if how == "replace":
        path, value = data.draw(st.sampled_from(nodes), label="node")
        new = data.draw(_json_any, label="value")
        return join(leaves, _set(meta, path, new)), f"{path}: {value!r:.60} -> {new!r:.60}"
    containers = [(p, v) for p, v in nodes if isinstance(v, (dict, list)) and v]
    if how == "add":
        dicts = [(p, v) for p, v in nodes if isinstance(v, dict)]
        path, node = data.draw(st.sampled_from(dicts), label="dict")
        key = data.draw(st.sampled_from(_NEW_KEYS), label="key")
        node[key] = data.draw(_json_any, label="value")
        return join(leaves, meta), f"{path}: added {key!r}"
    if not containers:
        return raw, "unchanged"
    path, node = data.draw(st.sampled_from(containers), label="container")
    if isinstance(node, list):
        i = data.draw(st.integers(0, len(node) - 1), label="index")
        if how == "delete":
            del node[i]
        elif how == "duplicate":
            node.insert(i, json.loads(json.dumps(node[i])))
        else:
            node.reverse()
        return join(leaves, meta), f"{path}[{i}]: {how}"
    key = data.draw(st.sampled_from(list(node)), label="key")
    if how == "delete":
        del node[key]
    elif how == "duplicate":  # the same entry under a second name, after the first
        node[f"{key}2"] = json.loads(json.dumps(node[key]))
    else:
        node[data.draw(st.sampled_from(_NEW_KEYS), label="new name")] = node.pop(key)
    return join(leaves, meta), f"{path}[{key!r}]: {how}"


# -- the contract ------------------------------------------------------------------------------


def _leaves(obj: Any, key: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every entry under ``obj`` by key; a lazy stack member by member (their shapes may
    differ, so the stack's own ``items`` would try to stack them)."""
    if isinstance(obj, LazyStackedTensorDict):
        for i, member in enumerate(obj.tensordicts):
            yield from _leaves(member, (*key, str(i)))
        return
    for name, value in obj.items():
        if isinstance(value, torch.Tensor):
            yield (*key, name), value
        elif isinstance(value, (TensorDict, LazyStackedTensorDict)):
            yield from _leaves(value, (*key, name))
        else:
            yield (*key, name), repr(value)


def _snapshot(td: Any) -> dict[Any, Any]:
    return {
        key: value.clone() if isinstance(value, torch.Tensor) else value
        for key, value in _leaves(td)
    }


def _same(td: Any, shot: dict[Any, Any]) -> bool:
    now = dict(_leaves(td))
    if list(now) != list(shot):
        return False
    return all(
        torch.equal(value, shot[key]) if isinstance(value, torch.Tensor) else value == shot[key]
        for key, value in now.items()
    )


def _read_every_byte(obj: Any) -> None:
    """Touch every byte of every leaf (a leaf mapped past the file's end dies here)."""
    for _key, value in _leaves(obj):
        if isinstance(value, torch.Tensor) and value.numel():
            value.reshape(-1).view(torch.uint8).sum()


def _overlapping(obj: Any) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Pairs of leaves whose bytes overlap (every leaf has bytes of its own)."""
    spans = sorted(
        (value.data_ptr(), value.data_ptr() + value.numel() * value.element_size(), key)
        for key, value in _leaves(obj)
        if isinstance(value, torch.Tensor) and value.numel()
    )
    return [(a[2], b[2]) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


def check_mutant(path: Path, seed: str, what: str) -> str:
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            report = tdckpt.validate(path)
            valid: bool | None = report.ok
        except TdckptError:
            valid = None  # not even read as a checkpoint: a load must refuse it too
        try:
            loaded = tdckpt.load_memmap(path, allow_pickle=False)
        except TdckptError as exc:
            assert not valid, f"{what}: validate called it valid, load_memmap refused: {exc}"
            outcome = "refused"
        else:
            assert valid, f"{what}: load_memmap took a file validate did not call valid"
            _read_every_byte(loaded)
            assert not _overlapping(loaded), f"{what}: leaves share bytes: {_overlapping(loaded)}"
            outcome = "restored"
        target = SEEDS[seed].clone()
        shot = _snapshot(target)
        try:
            tdckpt.load_memmap_(target, path, allow_pickle=False)
        except TdckptError:
            assert _same(target, shot), f"{what}: load_memmap_ refused, but changed the target"
        else:
            assert outcome == "restored", f"{what}: load_memmap_ took what load_memmap refused"
            _read_every_byte(target)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before, f"{what}: the file changed"
    return outcome


def test_the_seeds_restore(pristine: dict[str, Path]) -> None:
    for name, path in pristine.items():
        assert check_mutant(path, name, f"seed {name}") == "restored"


def test_fuzz_consolidated(fuzz_examples: int, pristine: dict[str, Path]) -> None:
    outcomes: dict[str, int] = {}

    @fuzz_settings(fuzz_examples)
    @given(data=st.data())
    def run(data: Any) -> None:
        seed = data.draw(st.sampled_from(sorted(pristine)), label="seed")
        raw, what = mutate(data, pristine[seed].read_bytes())
        with tempfile.TemporaryDirectory(prefix="tdckpt-fuzz-cons-") as tmp:
            path = Path(tmp) / "mutant.bin"
            path.write_bytes(raw)
            with alarm(WATCHDOG_S, AssertionError(f"hang: {what} took over {WATCHDOG_S} s")):
                outcome = check_mutant(path, seed, f"{seed}: {what}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    run()
    # both outcomes occur: the mutations neither always break nor never break the file
    if fuzz_examples >= 100:
        assert outcomes.get("refused", 0) and outcomes.get("restored", 0), outcomes


def test_the_unmutated_file_rewritten_restores_the_same(
    pristine: dict[str, Path], tmp_path: Path
) -> None:
    # The harness itself (split, then join) breaks nothing: what mutants lose, mutation lost.
    for name, path in pristine.items():
        leaves, meta = split(path.read_bytes())
        again = tmp_path / f"{name}.bin"
        again.write_bytes(join(leaves, meta))
        assert split(again.read_bytes()) == (leaves, meta)
        ours, theirs = tdckpt.load_memmap(again), TensorDict.from_consolidated(path)
        assert sorted(map(str, ours.keys(True, True))) == sorted(map(str, theirs.keys(True, True)))
        for key, value in theirs.items(True, True):
            if isinstance(value, torch.Tensor):
                assert torch.equal(ours.get(key), value), (name, key)
