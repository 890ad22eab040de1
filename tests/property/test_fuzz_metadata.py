"""Metadata fuzzer: "validate says ok" must mean "restore succeeds".

Real checkpoints - the tensordict fixture corpus (G1 ``meta.pt`` through 0.15.3, archives,
tensorclasses, lazy stacks, non-tensor data), views and lazy views written by tensordict
0.15.3, and checkpoints written by tdckpt itself (with a manifest) - are copied and their
metadata mutated: values, types, shapes, dtypes, devices, class names, keys, view indices,
stacks (``stack_dim``, member directories), manifest checksums. For every mutant:

* either ``tdckpt.validate`` reports an error, and then ``tdckpt.load_memmap`` and
  ``tdckpt.load_memmap_`` (into a real tensordict built from the unmutated checkpoint)
  raise a :class:`~tdckpt.errors.TdckptError`, the target is unchanged (keys, values,
  batch size, lock and memmap state) and the prefix is byte-identical;
* or validate passes, and ``load_memmap`` succeeds and gives an object whose every leaf
  can be read. ``load_memmap_`` into the unmutated checkpoint's object then succeeds or
  refuses with a :class:`~tdckpt.errors.RestoreError` (that target may legitimately no
  longer fit), again with the target unchanged and the prefix untouched.

Never another exception type, never a hang (each example runs under a watchdog).

Validation cannot know two things that only the restoring process decides, so a
``load_memmap`` after a clean validation may refuse with a RestoreError that says so:
a non-CPU device recorded in the metadata (then ``device="cpu"`` must load it), and a
tensorclass whose module is not imported in this process.

The number of examples is ``--fuzz-examples=N`` (or ``TDCKPT_FUZZ_EXAMPLES``); the default
is sized for CI. ``python -m pytest tests/property/test_fuzz_metadata.py --fuzz-examples=2000``
is the long run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import EXTRA_FIXTURES, alarm, copy_case, fixture_cases, fuzz_settings, tree_digest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import tdckpt
from tdckpt.errors import RestoreError, TdckptError

tensordict = pytest.importorskip("tensordict")
import fixture_types  # noqa: E402, F401 - the corpus's tensorclass and pickled classes resolve
from tensordict import (  # noqa: E402
    LazyStackedTensorDict,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_tensorclass,
)
from tensordict.tensorclass import NonTensorDataBase  # noqa: E402

#: Seconds one example may take before the watchdog calls it a hang.
WATCHDOG_S = 60

# -- seeds -------------------------------------------------------------------------------------

_CASES = (
    "flat",
    "nested",
    "lazy_stack",
    "tensorclass",
    "tensorclass_in_td",
    "non_tensor_json",
    "non_tensor_lossy",
    "non_tensor_pickle",
    "nested_tensor_strided",
    "zero_numel",
    "empty_td",
    "exotic_dtypes",
    "odd_keys__default",
    "odd_nested__robust_true",
    "archive_stored",
    "archive_deflate",
)


def _fixture_seeds() -> list[Any]:
    seeds = list(fixture_cases(where=lambda fc: fc.name in _CASES))
    seeds += fixture_cases(
        root=EXTRA_FIXTURES,
        where=lambda fc: fc.name in ("lazy_stack", "tensorclass", "nested", "non_tensor_json"),
    )
    return seeds


FIXTURE_SEEDS = _fixture_seeds()


def _generated() -> dict[str, Any]:
    """Checkpoints written here by tensordict 0.15.3 (views) and by tdckpt (manifests)."""
    from tensordict._lazy import _PermutedTensorDict, _UnsqueezedTensorDict, _ViewedTensorDict

    def src() -> Any:
        return TensorDict(
            a=torch.arange(24.0).reshape(2, 3, 4),
            b=torch.arange(6).reshape(2, 3),
            n=TensorDict(c=torch.arange(12).reshape(2, 3, 2), batch_size=[2, 3]),
            batch_size=[2, 3],
        )

    def stack() -> Any:
        return LazyStackedTensorDict(
            *(TensorDict(x=torch.full((2, i + 1), float(i)), batch_size=[2]) for i in range(3)),
            stack_dim=1,
        )

    td = src()
    return {
        "sub_slice": ("td", td._get_sub_tensordict(slice(0, 1))),
        "sub_tuple": ("td", td._get_sub_tensordict((slice(None), 2))),
        "sub_tensor": ("td", td._get_sub_tensordict(torch.tensor([1, 0]))),
        "sub_mask": (
            "td",
            td._get_sub_tensordict((slice(None), torch.tensor([True, False, True]))),
        ),
        "unsqueeze": (
            "td",
            _UnsqueezedTensorDict(
                td,
                custom_op="unsqueeze",
                inv_op="squeeze",
                custom_op_kwargs={"dim": 1},
                inv_op_kwargs={"dim": 1},
            ),
        ),
        "permute": (
            "td",
            _PermutedTensorDict(
                td,
                custom_op="permute",
                inv_op="permute",
                custom_op_kwargs={"dims": [1, 0]},
                inv_op_kwargs={"dims": [1, 0]},
            ),
        ),
        "view": (
            "td",
            _ViewedTensorDict(
                td,
                custom_op="view",
                inv_op="view",
                custom_op_kwargs={"size": [6]},
                inv_op_kwargs={"size": [2, 3]},
            ),
        ),
        "stack_dim1": ("td", stack()),
        "tdckpt_nested": ("tdckpt", src()),
        "tdckpt_stack": ("tdckpt", stack()),
        "tdckpt_non_tensor": (
            "tdckpt",
            TensorDict(a=torch.ones(3), s=NonTensorStack("x", "y", "z"), batch_size=[3]),
        ),
        "tdckpt_archive": ("tdckpt.tdz", src()),
    }


GENERATED = sorted(_generated())


@pytest.fixture(scope="module")
def generated_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every generated seed, written once: ``<dir>/<name>/ckpt`` (or ``ckpt.tdz``)."""
    base = tmp_path_factory.mktemp("fuzz-seeds")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (writer, obj) in _generated().items():
            (base / name).mkdir()
            if writer == "td":
                obj.memmap(base / name / "ckpt")
            elif writer == "tdckpt":
                tdckpt.save(obj, base / name / "ckpt", fsync=False)
            else:
                tdckpt.save(obj, base / name / "ckpt.tdz", fsync=False)
    return base


def _copy_seed(seed: Any, generated: Path, dest: Path) -> Path:
    if isinstance(seed, str):
        src = generated / seed
        shutil.copytree(src, dest / seed, symlinks=True)
        (target,) = (dest / seed).iterdir()
        return target
    return copy_case(dest, seed)


# -- values ----------------------------------------------------------------------------------

_EDGE_INTS = [
    0,
    1,
    2,
    3,
    -1,
    -2,
    63,
    64,
    65,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**62,
    2**62 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    -(2**63) - 1,
    10**30,
]
_DTYPES = sorted(
    {str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}
    | {
        "torch.float",
        "float32",
        "torch.int",
        "torch.Float32",
        "torch.",
        "",
        "torch.float32 ",
        "torch.uint4",
    }
)
_DEVICES = [
    "cpu",
    "cpu:0",
    "cpu:1",
    "cpu:-1",
    "cuda",
    "cuda:0",
    "cuda:-1",
    "cuda:99999999999999999999",
    "meta",
    "mps",
    "xpu",
    "xla",
    "hpu",
    "mkldnn",
    "opengl",
    "opencl",
    "ideep",
    "hip",
    "ve",
    "fpga",
    "maia",
    "vulkan",
    "mtia",
    "lazy",
    "ipu",
    "privateuseone",
    "None",
    "",
    "cpu:0:0",
    "cpu:2147483648",
    " cpu",
    "CPU",
    "cuda:1",
]
_TYPES = [
    "<class 'tensordict._td.TensorDict'>",
    "<class 'tensordict._lazy.LazyStackedTensorDict'>",
    "<class 'tensordict._td._SubTensorDict'>",
    "<class 'tensordict._lazy._UnsqueezedTensorDict'>",
    "<class 'tensordict.tensorclass.NonTensorData'>",
    "<class 'tensordict.tensorclass.MetaData'>",
    "<class 'tensordict.tensorclass.NonTensorStack'>",
    "<class 'tensordict.TensorDictParams'>",
    "<class 'tensordict.nn.params.TensorDictParams'>",
    "<class 'tensordict.persistent.PersistentTensorDict'>",
    "<class 'fixture_types.FixtureTC'>",
    "<class 'fixture_types.FixtureTCSub'>",
    "<class 'fixture_types.Point'>",
    "<class 'fixture_types.torch'>",
    "<class 'fixture_types.typing'>",
    "<class 'fixture_types.__name__'>",
    "<class 'fixture_types.FixtureTC.__init__'>",
    "<class 'fixture_types.<locals>.X'>",
    "<class 'builtins.int'>",
    "<class 'builtins.dict'>",
    "<class 'os.path'>",
    "<class 'torch.Tensor'>",
    "<class 'tensordict.TensorDict'>",
    "<class 'not_imported_module.Thing'>",
    "<class 'sys.modules'>",
    "<class ''>",
    "<class '.'>",
    "FixtureTC",
    "",
]
_CLASSES = [
    "tensordict:TensorDict",
    "tensordict._td:TensorDict",
    "tensordict:LazyStackedTensorDict",
    "tensordict._lazy:LazyStackedTensorDict",
    "tensordict._td:_SubTensorDict",
    "tensordict._lazy:_UnsqueezedTensorDict",
    "tensordict._lazy:_PermutedTensorDict",
    "tensordict._lazy:_CustomOpTensorDict",
    "tensordict.tensorclass:NonTensorData",
    "tensordict.tensorclass:NonTensorStack",
    "tensordict:TensorDictParams",
    "tensordict:PersistentTensorDict",
    "tensordict:TypedTensorDict",
    "tensordict:TensorDictStore",
    "fixture_types:FixtureTC",
    "fixture_types:Point",
    "builtins:int",
    "os:system",
    "tensordict",
    ":",
    "",
]
_OPS = [
    "squeeze",
    "unsqueeze",
    "view",
    "transpose",
    "permute",
    "reshape",
    "flatten",
    "__init__",
    None,
]
_CHECKSUMS = [
    "crc32:00000000",
    "crc32:0",
    "crc32:",
    "sha256:00",
    "md5:d41d8cd98f00b204e9800998ecf8427e",
    "sha1:da39a3ee5e6b4b0d3255bfef95601890afd80709",
    "shake_128:00",
    "shake_256:00",
    "sha3_256:00",
    "blake2b:00",
    "blake2s:00",
    "md4:00",
    "sm3:00",
    "ripemd160:00",
    "whirlpool:00",
    "crc32c:00",
    "adler32:00",
    "xxh64:00",
    "sha512_224:00",
    "sha512_256:00",
    "mdc2:00",
    "none:00",
    "a:0",
]

_small_ints = st.integers(-3, 8)
_dims = st.one_of(st.integers(0, 7), st.sampled_from(_EDGE_INTS))
_shapes = st.one_of(
    st.lists(st.integers(0, 6), max_size=4),
    st.lists(_dims, max_size=5),
    st.lists(st.integers(1, 2), min_size=60, max_size=70),
)
_names = st.one_of(
    st.none(), st.lists(st.one_of(st.none(), st.text(max_size=3), _small_ints), max_size=4)
)


def _index_values() -> st.SearchStrategy[Any]:
    scalar = st.one_of(_small_ints, st.sampled_from(_EDGE_INTS), st.none(), st.booleans())
    sl = st.builds(
        lambda tag, a, b, c: [tag, {"start": a, "stop": b, "step": c}],
        st.sampled_from(["slice", "range"]),
        st.one_of(st.none(), _small_ints),
        st.one_of(st.none(), _small_ints, st.sampled_from([2**62, 2**63])),
        st.one_of(st.none(), st.integers(-1, 3)),
    )
    tensor = st.builds(
        lambda v, d: ["tensor", v, d],
        st.one_of(
            st.lists(_small_ints, max_size=4),
            st.lists(st.booleans(), max_size=4),
            st.lists(st.lists(st.booleans(), min_size=3, max_size=3), max_size=3),
            st.lists(st.lists(_small_ints, max_size=2), max_size=3),
            st.lists(st.floats(-2, 2, allow_nan=False), max_size=2),
            _small_ints,
        ),
        st.sampled_from(["cpu", "meta", "cuda", "cpu:0", "zz"]),
    )
    base = st.one_of(scalar, sl, tensor, st.just(["ellipsis"]))
    return st.one_of(
        base,
        st.builds(
            lambda t, items: [t, items],
            st.sampled_from(["tuple", "list"]),
            st.lists(base, max_size=4),
        ),
        st.lists(base, max_size=3),
    )


_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    _small_ints,
    st.sampled_from(_EDGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.text(max_size=6),
)
_json_any = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)

_DOMAIN: dict[str, st.SearchStrategy[Any]] = {
    "dtype": st.sampled_from(_DTYPES),
    "device": st.sampled_from(_DEVICES),
    "_type": st.sampled_from(_TYPES),
    "type": st.sampled_from(_TYPES),
    "_class": st.sampled_from(_CLASSES),
    "shape": _shapes,
    "size": _shapes,
    "dims": _shapes,
    "batch_size": _shapes,
    "stack_dim": st.one_of(_small_ints, st.sampled_from(_EDGE_INTS)),
    "dim": st.one_of(_small_ints, st.lists(_small_ints, max_size=3)),
    "dim0": _small_ints,
    "dim1": _small_ints,
    "_names": _names,
    "stack_dim_name": st.one_of(st.none(), st.text(max_size=3), _small_ints),
    "index": _index_values(),
    "custom_op": st.sampled_from(_OPS),
    "inv_op": st.sampled_from(_OPS),
    "checksum": st.one_of(st.sampled_from(_CHECKSUMS), st.none()),
    "size_bytes": st.sampled_from(_EDGE_INTS),
    "is_nested": st.one_of(st.booleans(), _small_ints),
    "_format_version": st.one_of(_small_ints, st.sampled_from([1, 1.0, "1", True, 2])),
    "data": _json_any,
    "kind": st.sampled_from(["other.pickle", "pickle.pkl", "x"]),
    "key_encoding": st.sampled_from(["robust", "legacy", "raw", None]),
    "schema_version": st.sampled_from([0, 1, 2, -1, "1", 2**63]),
}
_NEW_KEYS = [
    "_names",
    "_format_version",
    "_class",
    "_type",
    "stack_dim",
    "stack_dim_name",
    "device",
    "data",
    "is_nested",
    "shape",
    "dtype",
    "index",
    "custom_op",
    "_metadata",
    "_is_non_tensor",
    "x",
    "0",
    "_tensordict",
    "_source",
    "__proto__",
    "%2E",
    "..",
]


def _domain_value(data: Any, key: Any) -> Any:
    strategy = _DOMAIN.get(key) if isinstance(key, str) else None
    if strategy is not None and data.draw(st.integers(0, 9), label="domain?") < 8:
        return data.draw(strategy, label=f"value for {key!r}")
    return data.draw(
        st.one_of(_json_any, st.sampled_from(_DTYPES + _DEVICES + _TYPES + _CLASSES), _shapes),
        label="value",
    )


def _entry_value(data: Any) -> Any:
    return data.draw(
        st.one_of(
            st.fixed_dictionaries(
                {"dtype": st.sampled_from(_DTYPES), "shape": _shapes},
                optional={"device": st.sampled_from(_DEVICES), "is_nested": st.booleans()},
            ),
            st.fixed_dictionaries({"type": st.sampled_from(_TYPES)}),
        ),
        label="entry",
    )


def _retype(data: Any, value: Any) -> Any:
    """The same content in another JSON type."""
    options: list[Any] = [str(value), [value], {"x": value}, None]
    if isinstance(value, bool):
        options += [int(value), "true"]
    elif isinstance(value, int):
        options += [
            float(value),
            value != 0,
            -value,
            value + 1,
            value - 1,
            value * 2**40,
            str(value),
        ]
    elif isinstance(value, float):
        options += [int(value) if math.isfinite(value) else 0]
    elif isinstance(value, list):
        options += [
            {str(i): v for i, v in enumerate(value)},
            tuple(value) and value[:-1],
            value + value[-1:],
            value[::-1],
            [],
        ]
    elif isinstance(value, dict):
        options += [list(value.values()), list(value), {}]
    elif isinstance(value, str):
        options += [value.upper(), value + "x", value[:-1], value.encode("utf-8", "replace").hex()]
    return data.draw(st.sampled_from(options), label="retyped")


# -- checkpoints as editable documents --------------------------------------------------------


class Mutable:
    """A checkpoint on disk (directory or .tdz) whose metadata can be edited and written back."""

    def __init__(self, prefix: Path, donors: list[Path] | None = None) -> None:
        self.prefix = prefix
        self.donors = donors or []
        self.archive = prefix.is_file()
        self.docs: dict[str, Any] = {}
        self.pts: dict[str, dict[Any, Any]] = {}
        self.dirty: set[str] = set()
        if self.archive:
            with zipfile.ZipFile(prefix) as zf:
                for name in zf.namelist():
                    if name.endswith(("meta.json", ".manifest.json")):
                        self.docs[name] = json.loads(zf.read(name))
        else:
            for dirpath, _dirs, files in os.walk(prefix):
                for name in files:
                    rel = (Path(dirpath) / name).relative_to(prefix).as_posix()
                    if name in ("meta.json", "tdckpt.manifest.json"):
                        self.docs[rel] = json.loads((prefix / rel).read_text(encoding="utf-8"))
                    elif name.endswith("meta.pt"):
                        self.pts[rel] = torch.load(prefix / rel, weights_only=True)

    # positions ---------------------------------------------------------------------------
    def positions(self) -> list[tuple[str, tuple[Any, ...]]]:
        out: list[tuple[str, tuple[Any, ...]]] = []

        def walk(rel: str, value: Any, path: tuple[Any, ...]) -> None:
            out.append((rel, path))
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(rel, v, (*path, k))
            elif isinstance(value, list) and len(value) <= 16:
                for i, v in enumerate(value):
                    walk(rel, v, (*path, i))

        for rel in sorted(self.docs):
            walk(rel, self.docs[rel], ())
        return out

    def get(self, rel: str, path: tuple[Any, ...]) -> Any:
        cur = self.docs[rel]
        for p in path:
            cur = cur[p]
        return cur

    def put(self, rel: str, path: tuple[Any, ...], value: Any) -> None:
        self.dirty.add(rel)
        if not path:
            self.docs[rel] = value
            return
        self.get(rel, path[:-1])[path[-1]] = value

    # mutations -----------------------------------------------------------------------------
    def new_key(self, data: Any) -> str:
        """A key name: a format field, one this checkpoint uses elsewhere, or any text."""
        seen = sorted(
            {k for rel, path in self.positions() for k in path[-1:] if isinstance(k, str)}
        )
        return data.draw(
            st.one_of(
                st.sampled_from(_NEW_KEYS), st.sampled_from(seen or _NEW_KEYS), st.text(max_size=4)
            ),
            label="new key",
        )

    def mutate_json(self, data: Any) -> str:
        rel, path = data.draw(st.sampled_from(self.positions()), label="position")
        value = self.get(rel, path)
        key = path[-1] if path else None
        parent_key = path[-2] if len(path) >= 2 else None
        name_key = key if isinstance(key, str) else parent_key
        ops = ["replace", "retype"]
        if path:
            ops.append("delete")
        if isinstance(value, dict):
            ops += ["add", "add_entry", "rename"] if value else ["add", "add_entry"]
        if isinstance(value, list):
            ops += ["append", "pop"] if value else ["append"]
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "replace":
            self.put(rel, path, _domain_value(data, name_key))
        elif op == "retype":
            self.put(rel, path, _retype(data, value))
        elif op == "delete":
            container = self.get(rel, path[:-1])
            del container[path[-1]]
            self.dirty.add(rel)
        elif op == "add":
            new = self.new_key(data)
            value[new] = _domain_value(data, new)
            self.dirty.add(rel)
        elif op == "add_entry":
            new = self.new_key(data)
            value[new] = _entry_value(data)
            self.dirty.add(rel)
        elif op == "rename":
            old = data.draw(st.sampled_from(sorted(value, key=str)), label="old key")
            new = self.new_key(data)
            value[new] = value.pop(old)
            self.dirty.add(rel)
        elif op == "append":
            value.append(_domain_value(data, parent_key if isinstance(parent_key, str) else key))
            self.dirty.add(rel)
        elif op == "pop":
            value.pop(data.draw(st.integers(0, len(value) - 1), label="pop at"))
            self.dirty.add(rel)
        return f"{op} {rel}:{list(path)}"

    def mutate_pt(self, data: Any) -> str:
        rel = data.draw(st.sampled_from(sorted(self.pts)), label="meta.pt")
        doc = self.pts[rel]
        keys = sorted(doc, key=str)
        pool = st.one_of(
            st.builds(torch.Size, st.lists(st.integers(0, 6), max_size=4)),
            st.builds(
                torch.Size, st.lists(st.sampled_from([0, 1, 2**31, 2**62, 2**63 - 1]), max_size=3)
            ),
            st.sampled_from(
                [
                    None,
                    0,
                    -1,
                    3,
                    2**63 - 1,
                    "cpu",
                    "cuda:0",
                    torch.device("cpu"),
                    torch.device("meta"),
                ]
            ),
            st.sampled_from([v for v in vars(torch).values() if isinstance(v, torch.dtype)]),
            st.lists(st.integers(-1, 4), max_size=3),
            st.booleans(),
        )
        op = data.draw(
            st.sampled_from(["replace", "delete", "add"] if keys else ["add"]), label="pt op"
        )
        if op == "replace":
            key = data.draw(st.sampled_from(keys), label="pt key")
            doc[key] = data.draw(pool, label="pt value")
        elif op == "delete":
            key = data.draw(st.sampled_from(keys), label="pt key")
            del doc[key]
        else:
            key = data.draw(
                st.sampled_from(
                    ["batch_size", "shape", "dtype", "device", "stack_dim", "is_nested", "x"]
                )
            )
            doc[key] = data.draw(pool, label="pt value")
        self.dirty.add(rel)
        return f"pt {op} {rel}:{key!r}"

    def mutate_files(self, data: Any) -> str:
        """A structural edit: member directories and leaf files (directories only)."""
        self.write()  # earlier edits reach the disk first: the edit copies and moves files
        self.dirty.clear()
        dirs = sorted(
            p.relative_to(self.prefix).as_posix()
            for p in self.prefix.rglob("*")
            if p.is_dir() and not p.is_symlink()
        )
        leaves = sorted(
            p.relative_to(self.prefix).as_posix()
            for p in self.prefix.rglob("*.memmap")
            if p.is_file()
        )
        ops = []
        if dirs:
            ops += ["rm_dir", "dup_dir", "rename_dir"]
        if self.donors:
            ops += ["graft"] * 4
        if leaves:
            ops += ["truncate", "grow", "rm_leaf"]
        if not ops:
            return "no file op"
        op = data.draw(st.sampled_from(ops), label="file op")
        if op == "graft":
            # Another level of a real checkpoint (a NonTensorData, a tensorclass, a stack, a
            # view...) takes the place of a member, a child or a new key.
            donor = data.draw(st.sampled_from(self.donors), label="donor")
            where = data.draw(st.sampled_from(["", *dirs]), label="graft into")
            name = data.draw(
                st.sampled_from(
                    ["0", "1", "2", "3", "_tensordict", "_source", "lvl1", "sub", "s", "tc", "x"]
                ),
                label="as",
            )
            dst = self.prefix / where / name
            if dst.exists():
                shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
            shutil.copytree(donor, dst, symlinks=True, ignore=shutil.ignore_patterns("*.tdz"))
            rel = dst.relative_to(self.prefix).as_posix()
            self._rescan(rel)
            return f"graft {'/'.join(donor.parts[-4:])} -> {rel}"
        if op in ("rm_dir", "dup_dir", "rename_dir"):
            rel = data.draw(st.sampled_from(dirs), label="dir")
            src = self.prefix / rel
            if op == "rm_dir":
                shutil.rmtree(src)
            else:
                siblings = {p.name for p in src.parent.iterdir()}
                new = data.draw(
                    st.sampled_from(["0", "1", "2", "3", "4", "9", "_tensordict", "_source", "x"]),
                    label="new name",
                )
                if new in siblings:
                    return f"{op} {rel} (name taken)"
                if op == "dup_dir":
                    shutil.copytree(src, src.parent / new, symlinks=True)
                else:
                    src.rename(src.parent / new)
            self._rescan(rel)
            if op != "rm_dir":
                self._rescan((src.parent / new).relative_to(self.prefix).as_posix())
            return f"{op} {rel}"
        rel = data.draw(st.sampled_from(leaves), label="leaf")
        path = self.prefix / rel
        if op == "rm_leaf":
            path.unlink()
        elif op == "truncate":
            size = path.stat().st_size
            os.truncate(path, data.draw(st.integers(0, max(size - 1, 0)), label="new size"))
        else:
            with path.open("ab") as fh:
                fh.write(b"\0" * data.draw(st.integers(1, 64), label="grow by"))
        return f"{op} {rel}"

    def _rescan(self, rel_dir: str) -> None:
        """Re-read the documents under ``rel_dir`` after a structural edit there."""
        under = rel_dir.rstrip("/") + "/"
        for table in (self.docs, self.pts):
            for k in [k for k in table if k.startswith(under)]:
                del table[k]
        self.dirty = {k for k in self.dirty if not k.startswith(under)}
        top = self.prefix / rel_dir
        for path in sorted(top.rglob("*")) if top.is_dir() else []:
            rel = path.relative_to(self.prefix).as_posix()
            if path.name in ("meta.json", "tdckpt.manifest.json") and path.is_file():
                self.docs[rel] = json.loads(path.read_text(encoding="utf-8"))
            elif path.name.endswith("meta.pt") and path.is_file():
                self.pts[rel] = torch.load(path, weights_only=True)

    def write(self) -> None:
        if self.archive:
            with zipfile.ZipFile(self.prefix) as zf:
                entries = [(info, zf.read(info)) for info in zf.infolist()]
            with zipfile.ZipFile(self.prefix, "w") as zf:
                for info, raw in entries:
                    if info.filename in self.dirty:
                        raw = json.dumps(self.docs[info.filename]).encode()
                    zf.writestr(info, raw, compress_type=info.compress_type)
            return
        for rel in self.dirty:
            if rel in self.docs:
                (self.prefix / rel).write_text(json.dumps(self.docs[rel]), encoding="utf-8")
            else:
                torch.save(self.pts[rel], self.prefix / rel)


# -- the target and what "unchanged" means ---------------------------------------------------


def _tensor_digest(t: torch.Tensor) -> Any:
    if t.device.type == "meta":
        return ("meta", t.dtype, tuple(t.shape))
    if t.is_nested:
        return ("nested", t.dtype, [_tensor_digest(c) for c in t.unbind(0)])
    flat = t.detach().contiguous().reshape(-1)
    try:
        raw = flat.view(torch.uint8)
    except RuntimeError:
        return ("values", t.dtype, tuple(t.shape), repr(flat.tolist()))
    return ("bytes", t.dtype, tuple(t.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest())


def snapshot(obj: Any) -> Any:
    """A comparable description of ``obj``: identities, values, batch sizes, lock/memmap state.

    Reading every leaf also proves that a restored object is usable.
    """
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj), _tensor_digest(obj))
    if isinstance(obj, NonTensorStack):
        return ("nt-stack", id(obj), tuple(obj.batch_size), obj.stack_dim, repr(obj.tolist()))
    if isinstance(obj, NonTensorDataBase):
        return ("nt", id(obj), type(obj).__name__, tuple(obj.batch_size), repr(obj.data))
    if is_tensorclass(obj):
        fields = {k: repr(v) for k, v in obj._non_tensordict.items()}
        return ("tc", id(obj), type(obj), fields, snapshot(obj._tensordict))
    if isinstance(obj, LazyStackedTensorDict):
        return (
            "stack",
            id(obj),
            obj.stack_dim,
            tuple(obj.batch_size),
            obj.is_locked,
            [snapshot(m) for m in obj.tensordicts],
        )
    if isinstance(obj, TensorDict):
        try:
            memmap = obj.is_memmap()
        except RuntimeError:
            memmap = None
        return (
            "td",
            id(obj),
            tuple(obj.batch_size),
            obj.device,
            obj.is_locked,
            memmap,
            obj._memmap_prefix,
            getattr(obj, "_td_dim_names", None),
            {k: snapshot(v) for k, v in obj._tensordict.items()},
        )
    if isinstance(obj, TensorDictBase):  # sub-tensordicts and lazy views
        inner = getattr(obj, "_source", None)
        leaves = {
            k: _tensor_digest(v) for k, v in obj.items(True, True) if isinstance(v, torch.Tensor)
        }
        return ("view", id(obj), type(obj), tuple(obj.batch_size), leaves, snapshot(inner))
    if isinstance(obj, dict):
        return ("dict", id(obj), {k: snapshot(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return ("list", id(obj), [snapshot(v) for v in obj])
    return ("value", repr(obj))


def _load(prefix: Path, **kwargs: Any) -> Any:
    return tdckpt.load_memmap(prefix, robust_key=None, allow_pickle=True, **kwargs)


def _tolerated_refusal(exc: RestoreError, prefix: Path) -> bool:
    """A refusal that depends on the restoring process, not on the checkpoint (module doc)."""
    facts = vars(exc)
    if "device" in facts and "device='cpu'" in str(exc):
        _load(prefix, device="cpu")  # must load there
        return True
    name = facts.get("class_name")
    if isinstance(name, str) and "is not imported" in str(exc):
        return name.rpartition(".")[0] not in sys.modules
    return False


@contextlib.contextmanager
def watchdog(seconds: int, what: str) -> Iterator[None]:
    """Fail (instead of hanging) when the body runs longer than ``seconds``."""
    with alarm(seconds, AssertionError(f"hang: {what} took more than {seconds} s")):
        yield


def check_mutant(prefix: Path, pristine: Path, what: str) -> str:
    """The fuzzer's contract on one mutated prefix; returns "refused" or "restored"."""
    before = tree_digest(prefix)
    try:
        report = tdckpt.validate(prefix)
    except TdckptError:
        ok = False
    else:
        ok = report.ok
    assert tree_digest(prefix) == before, f"{what}: validate wrote to the prefix"

    # A target built from the unmutated checkpoint: a fresh in-memory copy, or the
    # memory-mapped (locked) object itself.
    original = _load(pristine)
    targets = [original]
    with contextlib.suppress(Exception):
        targets.append(original.clone())

    if not ok:
        with pytest.raises(TdckptError):
            _load(prefix)
        for target in targets:
            state = snapshot(target)
            with pytest.raises(TdckptError):
                tdckpt.load_memmap_(target, prefix, robust_key=None, allow_pickle=True)
            assert snapshot(target) == state, f"{what}: a refused restore changed the target"
        assert tree_digest(prefix) == before, f"{what}: a refused restore wrote to the prefix"
        return "refused"

    try:
        snapshot(_load(prefix))
    except RestoreError as exc:
        if not _tolerated_refusal(exc, prefix):
            raise AssertionError(
                f"{what}: validate passed, but load_memmap refused: {exc}"
            ) from exc
    for target in targets:
        state = snapshot(target)
        try:
            out = tdckpt.load_memmap_(target, prefix, robust_key=None, allow_pickle=True)
        except RestoreError:
            assert snapshot(target) == state, (
                f"{what}: a refused in-place restore changed the target"
            )
        else:
            assert out is target
            snapshot(target)
    assert tree_digest(prefix) == before, f"{what}: a restore wrote to the prefix"
    return "restored"


# -- the fuzzers -----------------------------------------------------------------------------

_SEEDS: list[Any] = [*FIXTURE_SEEDS, *GENERATED]


def _seed_id(seed: Any) -> str:
    return seed if isinstance(seed, str) else seed.id


_BY_ID = {_seed_id(seed): seed for seed in _SEEDS}


def _donors(pristine: dict[str, Path]) -> list[Path]:
    """Every level (a directory with a meta.json) of the current-format seeds."""
    out = []
    for name, prefix in sorted(pristine.items()):
        if prefix.is_dir() and (name.startswith("0.15.3-") or name in GENERATED):
            out += sorted(p.parent for p in prefix.rglob("meta.json"))
    return out


@pytest.fixture(scope="module")
def pristine_dir(generated_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One unmutated copy of every seed (the targets are loaded from these)."""
    base = tmp_path_factory.mktemp("fuzz-pristine")
    out = {}
    for i, seed in enumerate(_SEEDS):
        dest = base / str(i)
        dest.mkdir()
        out[_seed_id(seed)] = _copy_seed(seed, generated_dir, dest)
    return out


def test_the_seeds_validate_and_restore(pristine_dir: dict[str, Path]) -> None:
    """Every seed is a good checkpoint: the fuzzer mutates restorable input."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, prefix in pristine_dir.items():
            assert tdckpt.validate(prefix).ok, name
            assert check_mutant(prefix, prefix, name) == "restored", name


def test_fuzz_metadata(
    fuzz_examples: int, generated_dir: Path, pristine_dir: dict[str, Path]
) -> None:
    outcomes = {"refused": 0, "restored": 0}
    donors = _donors(pristine_dir)
    tally: dict[str, int] = {}

    @fuzz_settings(fuzz_examples)
    @given(data=st.data())
    def run(data: Any) -> None:
        seed = _BY_ID[data.draw(st.sampled_from(sorted(_BY_ID)), label="seed")]
        with tempfile.TemporaryDirectory(prefix="tdckpt-fuzz-") as tmp:
            prefix = _copy_seed(seed, generated_dir, Path(tmp))
            ck = Mutable(prefix, donors)
            done = []
            for _ in range(data.draw(st.integers(1, 3), label="mutations")):
                kinds = ["json"] * 6 if ck.docs else []
                kinds += ["pt"] * 3 if ck.pts else []
                kinds += ["files"] * 2 if not ck.archive else []
                if not kinds:
                    break
                kind = data.draw(st.sampled_from(kinds), label="kind")
                if kind == "json":
                    done.append(ck.mutate_json(data))
                elif kind == "pt":
                    done.append(ck.mutate_pt(data))
                else:
                    done.append(ck.mutate_files(data))
            ck.write()
            what = f"{_seed_id(seed)}: {'; '.join(done)}"
            with watchdog(WATCHDOG_S, what), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outcome = check_mutant(prefix, pristine_dir[_seed_id(seed)], what)
            outcomes[outcome] += 1
            event(outcome)
            tally[f"{outcome}: {done[0].split(' ')[0] if done else '-'}"] = (
                tally.get(f"{outcome}: {done[0].split(' ')[0] if done else '-'}", 0) + 1
            )

    run()
    print(f"metadata fuzzer: {outcomes} {sorted(tally.items())}")
    # Not a vacuous run: mutants were both refused and restored.
    if fuzz_examples >= 50:
        assert outcomes["refused"] and outcomes["restored"], outcomes


# -- the manager path: mutated manifests ----------------------------------------------------


@pytest.fixture(scope="module")
def manager_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-manager") / "run"
    td = TensorDict(
        a=torch.arange(6.0).reshape(3, 2),
        n=TensorDict(b=torch.ones(3), batch_size=[3]),
        batch_size=[3],
    )
    with tdckpt.CheckpointManager(root, fsync=False) as mgr:
        mgr.save(1, td)
    with tdckpt.CheckpointManager(root, fsync=False, checksum="sha256") as mgr:
        mgr.save(2, td)
    with tdckpt.CheckpointManager(root, fsync=False, archive=True, compression="deflate") as mgr:
        mgr.save(3, td)
    return root


def test_fuzz_manager_manifests(fuzz_examples: int, manager_root: Path) -> None:
    """``CheckpointManager.verify`` / ``restore`` on mutated manifests: a report or an error."""

    @settings(
        max_examples=max(fuzz_examples // 3, 10),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(data=st.data())
    def run(data: Any) -> None:
        with tempfile.TemporaryDirectory(prefix="tdckpt-fuzz-mgr-") as tmp:
            root = Path(tmp) / "run"
            shutil.copytree(manager_root, root, symlinks=True)
            step = data.draw(st.sampled_from([1, 2, 3]), label="step")
            (entry,) = (p for p in root.iterdir() if p.name.split(".")[0] == str(step))
            archive = entry.is_file()
            if archive:
                with zipfile.ZipFile(entry) as zf:
                    doc = json.loads(zf.read("tdckpt.manifest.json"))
            else:
                doc = json.loads((entry / "tdckpt.manifest.json").read_text())
            files = doc.get("files") or []
            op = data.draw(st.sampled_from(["checksum", "any"]), label="manifest op")
            if op == "checksum" and files:
                i = data.draw(st.integers(0, len(files) - 1), label="file")
                algo = data.draw(
                    st.one_of(
                        st.sampled_from([c.split(":")[0] for c in _CHECKSUMS]),
                        st.from_regex(r"[a-z0-9_]{1,8}", fullmatch=True),
                    ),
                    label="algorithm",
                )
                digest = data.draw(
                    st.one_of(
                        st.from_regex(r"[0-9a-f]{0,130}", fullmatch=True),
                        st.just((files[i].get("checksum") or ":").split(":")[1]),
                    ),
                    label="digest",
                )
                files[i]["checksum"] = f"{algo}:{digest}"
                what = f"checksum of {files[i].get('path')} = {files[i]['checksum']}"
            else:
                ck = Mutable.__new__(Mutable)
                ck.docs, ck.pts, ck.dirty = {"tdckpt.manifest.json": doc}, {}, set()
                what = ck.mutate_json(data)
                doc = ck.docs["tdckpt.manifest.json"]
            if archive:
                with zipfile.ZipFile(entry) as zf:
                    entries = [(info, zf.read(info)) for info in zf.infolist()]
                with zipfile.ZipFile(entry, "w") as zf:
                    for info, raw in entries:
                        if info.filename == "tdckpt.manifest.json":
                            raw = json.dumps(doc).encode()
                        zf.writestr(info, raw, compress_type=info.compress_type)
            else:
                (entry / "tdckpt.manifest.json").write_text(json.dumps(doc))
            before = tree_digest(root)
            with watchdog(WATCHDOG_S, what), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with tdckpt.CheckpointManager(root) as mgr:
                    try:
                        report = mgr.verify(step)
                    except TdckptError:
                        report = None
                    else:
                        assert isinstance(report, tdckpt.VerifyReport), what
                    target = TensorDict(
                        a=torch.zeros(3, 2),
                        n=TensorDict(b=torch.zeros(3), batch_size=[3]),
                        batch_size=[3],
                    )
                    state = snapshot(target)
                    try:
                        mgr.restore_into(target, step, verify=True)
                    except TdckptError:
                        assert snapshot(target) == state, what
                    else:
                        assert report is not None and report.ok, (
                            f"{what}: restored a step verify does not pass"
                        )
            assert tree_digest(root) == before, f"{what}: verify or restore wrote to the checkpoint"

    run()


def test_mutable_round_trips_an_archive(tmp_path: Path) -> None:
    """The fuzzer's archive rewriting itself keeps an unmutated archive restorable."""
    (fc,) = fixture_cases(versions=["0.15.3"], where=lambda fc: fc.name == "archive_deflate")
    prefix = copy_case(tmp_path, fc)
    ck = Mutable(prefix)
    ck.dirty = set(ck.docs)
    ck.write()
    assert tdckpt.validate(prefix).ok
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert sorted(tdckpt.load_memmap(prefix).keys()) == sorted(
            tdckpt.load_memmap(fc.target).keys()
        )
