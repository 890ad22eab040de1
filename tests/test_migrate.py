"""Migration steps (before/after literals), the chain checker, and the runner."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FixtureCase, case_id, copy_case, fixture_cases, tree_digest

import tdckpt._read.migrate as migrate_mod
import tdckpt._read.names as names_mod
from tdckpt._read.detect import detect_tree
from tdckpt._read.migrate import (
    MigrationContext,
    MigrationScript,
    check_chain,
    default_scripts,
    load_scripts,
    migrate_tree,
    migrations_dir,
)
from tdckpt._read.names import normalize_names
from tdckpt._read.opener import open_storage
from tdckpt._read.tree import VDir, VFile, read_tree
from tdckpt._read.validate import build_nodes
from tdckpt.errors import MigrationChainError, MigrationError

TD = "<class 'tensordict._td.TensorDict'>"
LS = "<class 'tensordict._lazy.LazyStackedTensorDict'>"
NTD = "<class 'tensordict.tensorclass.NonTensorData'>"
NTS = "<class 'tensordict.tensorclass.NonTensorStack'>"
TC = "<class 'fixture_types.FixtureTC'>"

SCRIPTS = {s.from_version: s for s in load_scripts(migrations_dir())}


def run_step(
    frm: int, tree: VDir, *, styles: dict[int, str] | None = None
) -> tuple[VDir, MigrationContext]:
    """Run one shipped step on a hand-built tree whose directories are all at ``frm``."""
    for node in tree.walk():
        node.generation = f"G{frm}"
    ctx = MigrationContext(step_from=frm, styles=styles or {})
    out = SCRIPTS[frm].upgrade(tree, ctx)
    assert out is tree
    return tree, ctx


def leaf(shape: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    return {"device": "cpu", "shape": shape or [3], "dtype": "torch.float32", **extra}


def td(entries: dict[str, Any] | None = None, shape: list[int] | None = None) -> dict[str, Any]:
    return {
        **(entries or {}),
        "shape": [3] if shape is None else shape,
        "device": "cpu",
        "_type": TD,
    }


def vdir(source: str, meta: dict[str, Any] | None = None, **dirs: VDir) -> VDir:
    return VDir(source=source, meta=meta, dirs=dict(dirs))


# == 0001: G1 -> G2 ===========================================================================


def pt_leaf(*shape: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return {"shape": torch.Size(shape), "device": torch.device("cpu"), "dtype": dtype}


def test_0001_tensordict() -> None:
    tree = VDir(
        source="",
        pt={
            "meta.pt": {"batch_size": torch.Size([3]), "device": None},
            "a.meta.pt": pt_leaf(3, 2),
            "b.meta.pt": pt_leaf(3, dtype=torch.int64),
        },
        files={"a.memmap": VFile("a.memmap", 24), "b.memmap": VFile("b.memmap", 24)},
        dirs={
            "nested": VDir(
                source="nested",
                pt={
                    "meta.pt": {"batch_size": torch.Size([3]), "device": torch.device("cpu")},
                    "c.meta.pt": pt_leaf(3, 1, dtype=torch.bool),
                },
            )
        },
    )
    run_step(1, tree)
    assert tree.meta == {
        "a": {"device": "cpu", "shape": [3, 2], "dtype": "torch.float32"},
        "b": {"device": "cpu", "shape": [3], "dtype": "torch.int64"},
        "shape": [3],
        "device": "None",  # device None is the string tensordict writes and reads back
        "_type": TD,
    }
    assert tree.dirs["nested"].meta == {
        "c": {"device": "cpu", "shape": [3, 1], "dtype": "torch.bool"},
        "shape": [3],
        "device": "cpu",
        "_type": TD,
    }
    assert tree.pt is None and tree.dirs["nested"].pt is None
    assert (tree.leaf_encoding, tree.dir_encoding) == ("legacy", "legacy")


def test_0001_slash_key_leaf_lives_one_directory_down() -> None:
    tree = VDir(
        source="",
        pt={"meta.pt": {"batch_size": torch.Size([3]), "device": None}},
        dirs={
            "a": VDir(
                source="a",
                pt={"b.meta.pt": pt_leaf(3)},
                files={"b.memmap": VFile("a/b.memmap", 12)},
            )
        },
    )
    run_step(1, tree)
    assert tree.meta is not None and tree.meta["a/b"] == leaf()
    assert tree.dirs["a"].pt is None


def test_0001_root_lazy_stack() -> None:
    tree = VDir(source="", pt={"meta.pt": {"stack_dim": 1}})
    run_step(1, tree)
    assert tree.meta == {"_type": LS, "stack_dim": 1}


def _g1_stack(batch: list[int], members: int, member_batch: list[int]) -> VDir:
    stack = VDir(
        source="ls",
        pt={"meta.pt": {"batch_size": torch.Size(batch), "device": None}},
        dirs={
            str(i): VDir(
                source=f"ls/{i}",
                pt={
                    "meta.pt": {"batch_size": torch.Size(member_batch), "device": None},
                    "x.meta.pt": pt_leaf(*member_batch, 2),
                },
            )
            for i in range(members)
        },
    )
    return VDir(
        source="",
        pt={"meta.pt": {"batch_size": torch.Size(batch[:1]), "device": None}},
        dirs={"ls": stack},
    )


def test_0001_nested_lazy_stack_rebuilt_and_stack_dim_inferred() -> None:
    tree = _g1_stack([3, 2], members=2, member_batch=[3])  # stacked along dim 1
    _, ctx = run_step(1, tree)
    assert tree.dirs["ls"].meta == {"_type": LS, "stack_dim": 1}
    assert tree.dirs["ls"].dirs["0"].meta == {**td({"x": leaf([3, 2])}), "device": "None"}
    assert any("'ls'" in s and "inferred as 1" in s for s in ctx.lost), ctx.lost


def test_0001_ambiguous_stack_dim_is_recorded_as_lost() -> None:
    tree = _g1_stack([2, 2], members=2, member_batch=[2])
    _, ctx = run_step(1, tree)
    assert tree.dirs["ls"].meta == {"_type": LS, "stack_dim": 0}
    assert any("any of the dimensions [0, 1]" in s for s in ctx.lost), ctx.lost


def test_0001_lazy_view_gets_a_source_directory() -> None:
    tree = VDir(
        source="",
        pt={
            "meta.pt": {
                "batch_size": torch.Size([3]),
                "device": None,
                "custom_op": "unsqueeze",
                "inv_op": "squeeze",
                "custom_op_kwargs": {"dim": 0},
                "inv_op_kwargs": {"dim": 0},
            },
            "a.meta.pt": pt_leaf(3, 2),
        },
        files={"a.memmap": VFile("a.memmap", 24)},
    )
    run_step(1, tree)
    assert tree.meta == {
        "shape": [1, 3],
        "device": "None",
        "_type": "<class 'tensordict._lazy._UnsqueezedTensorDict'>",
        "custom_op": "unsqueeze",
        "inv_op": "squeeze",
        "custom_op_kwargs": {"dim": 0},
        "inv_op_kwargs": {"dim": 0},
    }
    source = tree.dirs["_source"]
    assert source.meta == {"a": leaf([3, 2]), "shape": [3], "device": "None", "_type": TD}
    assert list(source.files) == ["a.memmap"] and tree.files == {}


def test_0001_missing_root_meta_pt_is_an_error() -> None:
    tree = VDir(source="", pt={"a.meta.pt": pt_leaf(3)})
    _, ctx = run_step(1, tree)
    assert [p.code for p in ctx.problems] == ["missing-meta"]
    assert ctx.problems[0].severity == "error"


def test_0001_notes_tensorclass_identity_loss() -> None:
    tree = VDir(source="", pt={"meta.pt": {"batch_size": torch.Size([3]), "device": None}})
    _, ctx = run_step(1, tree)
    assert any("tensorclass" in s and "never stored" in s for s in ctx.lost)


# == 0002: G2 -> G3 ===========================================================================


def test_0002_lists_unlisted_children_before_the_fields() -> None:
    tree = vdir(
        "",
        td({"x": leaf()}),
        nested=vdir("nested", td({"y": leaf()})),
        s=vdir("s", {"_type": NTD, "data": "hello", "_metadata": None, "_is_non_tensor": True}),
        tc=vdir("tc", {"_type": TC, "label": "episode-1"}),
        a=vdir("a", None, b=vdir("a/b", td({"v": leaf()}))),  # the legacy layout of key "a/b"
        junk=vdir("junk", None),  # holds no collection: left to the names stage
    )
    run_step(2, tree)
    assert list(tree.meta or {}) == ["x", "a/b", "nested", "s", "tc", "shape", "device", "_type"]
    assert tree.meta == {
        "x": leaf(),
        "a/b": {"type": "TensorDict"},
        "nested": {"type": "TensorDict"},
        "s": {"type": "NonTensorData"},
        "tc": {"type": "FixtureTC"},
        "shape": [3],
        "device": "cpu",
        "_type": TD,
    }
    assert (tree.leaf_encoding, tree.dir_encoding) == ("legacy", "legacy")


def test_0002_already_listed_children_untouched() -> None:
    meta = td({"x": leaf(), "n": {"type": "TensorDict"}})
    tree = vdir("", copy.deepcopy(meta), n=vdir("n", td()))
    run_step(2, tree)
    assert tree.meta == meta


def _ntd(value: Any, batch: list[int]) -> VDir:
    return vdir(
        "",
        {"_type": NTD, "data": value, "_metadata": None, "_is_non_tensor": True},
        _tensordict=vdir("", td(shape=batch)),
    )


def test_0002_lazy_stack_of_non_tensors_becomes_a_non_tensor_stack() -> None:
    stack = vdir("ls", {"_type": LS, "stack_dim": 0}, **{"0": _ntd("a", []), "1": _ntd("b", [])})
    tree = vdir("", td(shape=[2]), ls=stack)
    run_step(2, tree)
    assert stack.meta == {"_type": NTS, "stack_dim": 0, "device": None, "data": ["a", "b"]}
    assert stack.dirs == {}
    assert tree.meta is not None and tree.meta["ls"] == {"type": "NonTensorStack"}


def test_0002_non_tensor_stack_data_in_batch_order() -> None:
    # two members of batch [3] stacked along dim 1: batch [3, 2], rows are batch dim 0
    stack = vdir("ls", {"_type": LS, "stack_dim": 1}, **{"0": _ntd("a", [3]), "1": _ntd("b", [3])})
    tree = vdir("", td(shape=[3]), ls=stack)
    run_step(2, tree)
    assert stack.meta is not None
    assert stack.meta["data"] == [["a", "b"], ["a", "b"], ["a", "b"]]


def test_0002_pickled_members_stay_a_lazy_stack() -> None:
    member = vdir("ls/0", {"_type": NTD, "_metadata": None, "_is_non_tensor": True})
    member.files["other.pickle"] = VFile("ls/0/other.pickle", 30)
    stack = vdir("ls", {"_type": LS, "stack_dim": 0}, **{"0": member})
    tree = vdir("", td(shape=[1]), ls=stack)
    _, ctx = run_step(2, tree)
    assert stack.meta == {"_type": LS, "stack_dim": 0}
    assert [p.code for p in ctx.problems] == ["kept-lazy-stack"]


# == 0003: G3 -> G4 ===========================================================================


def test_0003_is_nested_flat_non_tensor_and_stack() -> None:
    s = _ntd("hello", [3])
    wide = _ntd("wide", [3, 4])  # records a batch its parent cannot provide: kept
    nts = vdir(
        "lst",
        {"_type": NTS, "stack_dim": 0, "device": None, "data": ["x", "y", "z"]},
        **{str(i): vdir(f"lst/{i}", td(shape=[])) for i in range(3)},
    )
    meta = td({"a": leaf(), "s": {"type": "NonTensorData"}, "w": {"type": "NonTensorData"}})
    tree = vdir("", meta, s=s, w=wide, lst=nts)
    _, ctx = run_step(3, tree)
    assert tree.meta is not None
    assert tree.meta["a"] == {
        "device": "cpu",
        "shape": [3],
        "dtype": "torch.float32",
        "is_nested": False,
    }
    assert "_tensordict" not in s.dirs
    assert "_tensordict" in wide.dirs
    assert [p.code for p in ctx.problems] == ["kept-non-tensor-batch"]
    assert nts.dirs == {}


def test_0003_tensorclass_fields_become_non_tensor_children() -> None:
    inner = vdir("tc/_tensordict", td({"obs": leaf()}))
    tc = vdir(
        "tc",
        {"_type": TC, "label": "episode-1", "extra": {"k": 1}, "none": None},
        _tensordict=inner,
    )
    tree = vdir("", td({"tc": {"type": "FixtureTC"}}), tc=tc)
    run_step(3, tree)
    assert tc.meta == {"_type": TC, "none": None}  # None-valued fields stay (0.5+ omits them)
    assert inner.meta == {
        "obs": leaf(is_nested=False),
        "label": {"type": "NonTensorData"},
        "extra": {"type": "NonTensorData"},
        "shape": [3],
        "device": "cpu",
        "_type": TD,
    }
    label = inner.dirs["label"].meta
    assert label == {"_type": NTD, "data": "episode-1", "_metadata": None, "_is_non_tensor": True}


# == 0004: G4 -> G5 ===========================================================================


def test_0004_changes_no_metadata() -> None:
    meta = td({"a b": leaf(is_nested=False)})
    tree = vdir("", copy.deepcopy(meta))
    tree.files["a b.memmap"] = VFile("a b.memmap", 12)
    run_step(4, tree)
    assert tree.meta == meta
    assert tree.leaf_encoding is None  # 0.11/0.12 could encode: decided from the files


# == 0005: G5 -> G6 ===========================================================================


def test_0005_raw_directory_names() -> None:
    tree = vdir("", td({"sub dir": {"type": "TensorDict"}}), **{"sub dir": vdir("sub dir", td())})
    run_step(5, tree)
    assert tree.dir_encoding == "legacy"
    assert tree.leaf_encoding is None


def test_0005_rewraps_a_tensorclass_saved_as_a_tensordict() -> None:
    good = vdir("good", {"_type": TC}, _tensordict=vdir("good/_tensordict", td({"obs": leaf()})))
    bad_inner = td({"obs": leaf(is_nested=False), "label": {"type": "NonTensorData"}})
    bad = vdir("bad", bad_inner)
    tree = vdir(
        "", td({"good": {"type": "FixtureTC"}, "bad": {"type": "FixtureTC"}}), good=good, bad=bad
    )
    _, ctx = run_step(5, tree)
    wrapped = tree.dirs["bad"]
    assert wrapped.meta == {"_type": TC}
    assert wrapped.dirs["_tensordict"] is bad and bad.meta == bad_inner
    assert [p.code for p in ctx.problems] == ["rewrapped-tensorclass"]


def test_0005_unknown_module_is_recorded_as_lost() -> None:
    tree = vdir("", td({"tc": {"type": "Foo"}}), tc=vdir("tc", td({"x": leaf()})))
    _, ctx = run_step(5, tree)
    assert tree.dirs["tc"].meta == td({"x": leaf()})
    assert any("'tc'" in s and "'Foo'" in s and "restores as a TensorDict" in s for s in ctx.lost)


# == 0006: G6 -> G7 ===========================================================================


def test_0006_points_out_metadata_pickles() -> None:
    s = vdir("s", {"_type": NTD, "data": "hello", "_is_non_tensor": True})
    s.files["other.pickle"] = VFile("s/other.pickle", 120)
    tree = vdir("", td({"s": {"type": "NonTensorData"}}), s=s)
    before = copy.deepcopy(s.meta)
    _, ctx = run_step(6, tree)
    assert s.meta == before
    assert [p.code for p in ctx.problems] == ["metadata-pickle"]
    assert "--convert-pickles" in ctx.problems[0].message


# == 0007: G7 -> G8 ===========================================================================


def test_0007_format_fields_where_0153_writes_them() -> None:
    members = {
        str(i): vdir(f"ls/{i}", td({"x": leaf(is_nested=False)}, shape=[])) for i in range(2)
    }
    ls = vdir("ls", {"_type": LS, "stack_dim": 0}, **members)
    nts = vdir("st", {"_type": NTS, "stack_dim": 0, "device": "None", "data": ["a", "b", "c"]})
    s = vdir("s", {"_type": NTD, "data": 1.5})
    tc = vdir(
        "tc", {"_type": TC}, _tensordict=vdir("tc/_tensordict", td({"obs": leaf(is_nested=False)}))
    )
    meta = td(
        {
            "a": leaf(is_nested=False),
            "ls": {"type": "LazyStackedTensorDict"},
            "st": {"type": "NonTensorStack"},
            "s": {"type": "NonTensorData"},
            "tc": {"type": "FixtureTC"},
        }
    )
    meta["device"] = None
    tree = vdir("", meta, ls=ls, st=nts, s=s, tc=tc)
    _, ctx = run_step(7, tree)
    assert tree.meta is not None
    assert list(tree.meta)[-5:] == ["shape", "device", "_type", "_format_version", "_class"]
    assert (tree.meta["_format_version"], tree.meta["_class"]) == (1, "tensordict:TensorDict")
    assert tree.meta["device"] == "None"
    assert ls.meta == {
        "_type": LS,
        "_format_version": 1,
        "_class": "tensordict:LazyStackedTensorDict",
        "stack_dim": 0,
        "stack_dim_name": None,
    }
    assert ls.dirs["0"].meta is not None and ls.dirs["0"].meta["_class"] == "tensordict:TensorDict"
    assert nts.meta == {
        "_type": NTS,
        "_format_version": 1,
        "_class": "tensordict:NonTensorStack",
        "stack_dim": 0,
        "device": None,
        "data": ["a", "b", "c"],
    }
    assert s.meta == {"_type": NTD, "data": 1.5, "_metadata": None, "_is_non_tensor": True}
    assert tc.meta == {"_type": TC}  # tensorclass levels carry no format fields
    inner = tc.dirs["_tensordict"].meta
    assert inner is not None and inner["_format_version"] == 1
    # Whether names were lost is unknowable: an info for validate/inspect, not a loss.
    assert not any("dimension names" in line for line in ctx.lost)
    assert any(p.code == "names-not-saved" and p.severity == "info" for p in ctx.problems)


def test_0007_null_is_non_tensor_becomes_true() -> None:
    # tensordict 0.5-0.9 wrote the containers of from_pytree with "_is_non_tensor": null
    p = vdir("p", {"_type": NTD, "_metadata": None, "_is_non_tensor": None})
    tree = vdir("", td({"p": {"type": "NonTensorData"}}), p=p)
    run_step(7, tree)
    assert p.meta == {"_type": NTD, "_metadata": None, "_is_non_tensor": True}


def test_0007_metadata_null_beside_an_accidental_pickle() -> None:
    # 0.5-0.14 re-saves: inline data, no _metadata, other.pickle holding the bookkeeping
    s = vdir("s", {"_type": NTD, "data": "hello"})
    s.files["other.pickle"] = VFile("s/other.pickle", 90)
    tree = vdir("", td({"s": {"type": "NonTensorData"}}), s=s)
    run_step(7, tree)
    # 0.15.3's form (the pickled _metadata still wins on load), and no longer the 0.5-0.14
    # marker: the upgraded tree detects as G8, so a second upgrade has nothing to do
    assert s.meta == {"_type": NTD, "data": "hello", "_metadata": None, "_is_non_tensor": True}
    assert detect_tree(tree) == "G8"


def test_0007_key_named_like_a_format_field_keeps_its_entry() -> None:
    meta = td({"_class": leaf(is_nested=False)})
    tree = vdir("", meta)
    run_step(7, tree)
    assert tree.meta is not None
    assert tree.meta["_class"] == leaf(is_nested=False)
    assert tree.meta["_format_version"] == 1


def test_0007_records_orjson_nulls_and_lists() -> None:
    s = vdir("s", {"_type": NTD, "data": None, "_metadata": None})
    t = vdir("t", {"_type": NTD, "data": [1, "two"], "_metadata": None})
    tree = vdir("", td({"s": {"type": "NonTensorData"}, "t": {"type": "NonTensorData"}}), s=s, t=t)
    _, ctx = run_step(7, tree, styles={id(s): "compact", id(t): "compact"})
    assert any(line.startswith("key 's'") and "NaN" in line for line in ctx.lost), ctx.lost
    assert not any(line.startswith("key 't'") for line in ctx.lost), ctx.lost
    assert [(p.code, p.severity, p.key) for p in ctx.problems if p.code == "json-list"] == [
        ("json-list", "info", ("t",))
    ]
    # the same null written by stdlib json (0.3, 0.4, 0.15.2+) is not ambiguous
    s2 = vdir("s", {"_type": NTD, "data": None, "_metadata": None})
    tree2 = vdir("", td({"s": {"type": "NonTensorData"}}), s=s2)
    _, ctx2 = run_step(7, tree2, styles={id(s2): "spaced"})
    assert not any("NaN" in line for line in ctx2.lost)


# == the chain ================================================================================


def _script(name: str, frm: int, to: int | None = None) -> MigrationScript:
    return MigrationScript(name, frm, frm + 1 if to is None else to, lambda tree, ctx: tree)


def _chain(*froms: int) -> Callable[[], list[MigrationScript]]:
    return lambda: [_script(f"{f:04d}_step", f) for f in froms]


def test_check_chain_accepts_a_contiguous_chain() -> None:
    chain = check_chain(_chain(3, 1, 2), current=4)
    assert [s.from_version for s in chain] == [1, 2, 3]


@pytest.mark.parametrize(
    ("froms", "current", "match"),
    [
        (
            (1, 2, 4),
            5,
            r"gap in the migration chain: 0002_step ends at G3 but the next script, 0004_step",
        ),
        ((2, 3), 4, r"must start at G1.*0002_step"),
        ((1, 2), 4, r"ends at G3 \(0002_step\), not at the current G4"),
        ((), 8, r"must start at G1 .*the first script is missing \(scripts: none\)"),
    ],
)
def test_check_chain_errors(froms: tuple[int, ...], current: int, match: str) -> None:
    with pytest.raises(MigrationChainError, match=match):
        check_chain(_chain(*froms), current=current)


def test_check_chain_duplicate() -> None:
    loader = lambda: [_script("0001_a", 1), _script("0001_b", 1), _script("0002_c", 2)]  # noqa: E731
    with pytest.raises(
        MigrationChainError, match="duplicate migration step: 0001_a and 0001_b"
    ) as err:
        check_chain(loader, current=3)
    assert err.value.script == "0001_b"


_GOOD = '''"""Step."""
FROM_VERSION = {frm}
TO_VERSION = {to}


def upgrade(tree, ctx):
    return tree
'''


def _write_scripts(directory: Path, steps: dict[str, tuple[Any, Any]]) -> Path:
    directory.mkdir()
    for name, (frm, to) in steps.items():
        (directory / name).write_text(_GOOD.format(frm=frm, to=to))
    return directory


def test_load_scripts_from_a_directory(tmp_path: Path) -> None:
    d = _write_scripts(
        tmp_path / "m",
        {
            "0001_one.py": (1, 2),
            "0002_two.py": (2, 3),
            "notes.py": (9, 10),
            "0003-bad-name.py": (3, 4),
        },
    )
    (d / "README.md").write_text("ignored")
    scripts = load_scripts(d)
    assert [(s.name, s.from_version, s.to_version, s.doc) for s in scripts] == [
        ("0001_one", 1, 2, "Step."),
        ("0002_two", 2, 3, "Step."),
    ]
    assert check_chain(lambda: scripts, current=3) == scripts


@pytest.mark.parametrize(
    ("steps", "match"),
    [
        (
            {"0001_a.py": (1, 2), "0002_b.py": (2, 3), "0004_d.py": (4, 5)},
            "gap in the migration chain",
        ),
        ({"0001_a.py": (1, 2), "0002_b.py": (1, 2)}, "duplicate migration step: 0001_a and 0002_b"),
        (
            {"0001_a.py": (1, 2), "0002_b.py": (2, 3)},
            r"ends at G3 \(0002_b\), not at the current G8",
        ),
        ({"0001_a.py": (1, 3)}, r"adjacent generations; found FROM_VERSION=1, TO_VERSION=3"),
        ({"0001_a.py": ("'G1'", "'G2'")}, "must be integers"),
    ],
)
def test_broken_script_directories(
    tmp_path: Path, steps: dict[str, tuple[Any, Any]], match: str
) -> None:
    d = _write_scripts(tmp_path / "m", steps)
    with pytest.raises(MigrationChainError, match=match):
        check_chain(lambda: load_scripts(d))


def test_script_without_upgrade_or_failing_import(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "0001_a.py").write_text("FROM_VERSION = 1\nTO_VERSION = 2\n")
    with pytest.raises(MigrationChainError, match=r"0001_a.py: .*missing upgrade"):
        load_scripts(d)
    (d / "0001_a.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(
        MigrationChainError, match=r"importing the migration script failed \(ModuleNotFoundError"
    ):
        load_scripts(d)


def test_shipped_chain() -> None:
    chain = default_scripts()
    assert [(s.from_version, s.to_version) for s in chain] == [(k, k + 1) for k in range(1, 8)]
    assert [s.name for s in chain] == [
        "0001_g1_meta_pt_to_json",
        "0002_g2_list_children",
        "0003_g3_is_nested_flat_nontensor",
        "0004_g4_robust_leaf_names",
        "0005_g5_robust_dir_names",
        "0006_g6_json_types",
        "0007_g7_format_v1",
    ]
    for s in chain:
        assert s.path is not None and s.path.parent == migrations_dir()
        text = s.path.read_text()
        assert s.doc and "#" in text.split('"""')[1], f"{s.name}: docstring must cite the PRs"
        # the helper API only: no torch, no tensordict, no pickle in a step
        for banned in (
            "import torch",
            "import tensordict",
            "from tensordict",
            "import pickle",
            "open(",
        ):
            assert banned not in text, f"{s.name} uses {banned!r}"


# == the runner ===============================================================================


def _g8_tree(dirs: int, leaves_per_dir: int) -> VDir:
    def level(source: str) -> dict[str, Any]:
        return {
            **{f"k{i}": leaf(is_nested=False) for i in range(leaves_per_dir)},
            "shape": [3],
            "device": "cpu",
            "_type": TD,
            "_format_version": 1,
            "_class": "tensordict:TensorDict",
        }

    root = VDir(source="", meta=level(""))
    for d in range(dirs):
        root.meta[f"d{d}"] = {"type": "TensorDict"}  # type: ignore[index]
        root.dirs[f"d{d}"] = VDir(source=f"d{d}", meta=level(f"d{d}"))
    return root


def test_current_form_has_near_zero_overhead(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = _g8_tree(dirs=100, leaves_per_dir=100)  # 10,000 leaves
    before = copy.deepcopy([n.meta for n in tree.walk()])

    def no_scripts() -> None:
        raise AssertionError("a current-form tree must not even load the scripts")

    monkeypatch.setattr(migrate_mod, "default_scripts", no_scripts)
    start = time.perf_counter()
    result = migrate_tree(tree)
    elapsed = time.perf_counter() - start
    assert result.applied == [] and result.lost == [] and result.problems == []
    assert result.from_generation == "G8"
    assert [n.meta for n in tree.walk()] == before
    assert elapsed < 0.25, f"{elapsed:.3f} s for a current-form tree of 10,000 leaves"


def test_current_form_reads_no_file(tmp_path: Path) -> None:
    target = copy_case(tmp_path, "0.15.3", "non_tensor_json")  # unmarked NonTensorData levels
    with open_storage(target) as storage:
        tree = read_tree(storage)
        reads: list[str] = []
        real = storage.read_bytes

        def counting(rel: str, **kwargs: Any) -> bytes:
            reads.append(rel)
            return real(rel, **kwargs)

        storage.read_bytes = counting  # type: ignore[method-assign]
        result = migrate_tree(tree, storage=storage)
    assert result.applied == [] and reads == []


def test_failing_step_names_the_script() -> None:
    def boom(tree: VDir, ctx: MigrationContext) -> VDir:
        raise KeyError("x")

    scripts = [
        MigrationScript("0001_boom", 1, 2, boom),
        *(_script(f"000{k}_ok", k) for k in range(2, 8)),
    ]
    tree = VDir(source="", pt={"meta.pt": {"batch_size": (3,), "device": None}})
    with pytest.raises(
        MigrationError, match=r"migration step 0001_boom \(G1 -> G2\) failed: KeyError"
    ) as err:
        migrate_tree(tree, scripts=scripts)
    assert err.value.script == "0001_boom"


def test_step_must_return_the_root() -> None:
    scripts = [
        MigrationScript("0001_new_root", 1, 2, lambda tree, ctx: VDir(source="")),
        *(_script(f"000{k}_ok", k) for k in range(2, 8)),
    ]
    tree = VDir(source="", pt={"meta.pt": {"batch_size": (3,), "device": None}})
    with pytest.raises(MigrationError, match="returned a different root"):
        migrate_tree(tree, scripts=scripts)


def test_mixed_tree_migrates_per_directory() -> None:
    old = vdir("old", td({"x": leaf()}))  # a 0.4-style level inside a 0.15.3 tree
    root = vdir(
        "",
        {
            **td({"old": {"type": "TensorDict"}}),
            "_format_version": 1,
            "_class": "tensordict:TensorDict",
        },
        old=old,
    )
    before = copy.deepcopy(root.meta)
    result = migrate_tree(root)
    assert root.meta == before
    assert old.meta is not None and old.meta["x"]["is_nested"] is False
    assert old.meta["_format_version"] == 1
    assert {n.generation for n in root.walk()} == {"G8"}
    assert result.applied[0] == "0002_g2_list_children"


def test_migrating_twice_is_a_no_op() -> None:
    tree = vdir("", td({"x": leaf()}), n=vdir("n", td({"y": leaf()})))
    first = migrate_tree(tree)
    snapshot = copy.deepcopy([n.meta for n in tree.walk()])
    second = migrate_tree(tree)
    assert first.applied and second.applied == []
    assert [n.meta for n in tree.walk()] == snapshot


# == every fixture, in memory =================================================================


@pytest.mark.parametrize("fc", fixture_cases(), ids=case_id)
def test_every_fixture_migrates_and_validates_in_memory(fc: FixtureCase, tmp_path: Path) -> None:
    target = copy_case(tmp_path, fc)
    before = tree_digest(target.parent)
    with open_storage(target) as storage:
        tree = read_tree(storage)
        result = migrate_tree(tree, storage=storage)
        names = normalize_names(result.tree, robust_key=None, storage=storage)
        root, problems = build_nodes(names.tree, storage)
    assert tree_digest(target.parent) == before, "migration must never write"
    errors = [
        str(p) for p in [*result.problems, *names.problems, *problems] if p.severity == "error"
    ]
    assert errors == [] and root is not None
    first = int(result.from_generation[1:])
    assert result.applied == [s.name for s in default_scripts()][first - 1 :]
    assert {n.generation for n in tree.walk()} == {"G8"}


@pytest.mark.parametrize("version", ["0.8.3", "0.12.4", "0.13.0", "0.14.3"])
def test_orjson_nan_loss_is_recorded(version: str, tmp_path: Path) -> None:
    target = copy_case(tmp_path, version, "non_tensor_lossy")
    with open_storage(target) as storage:
        result = migrate_tree(read_tree(storage), storage=storage)
    lost = "\n".join(result.lost)
    assert "key 'f_nan'" in lost and "key 'f_inf'" in lost and "NaN" in lost
    # a list may have been a tuple: said as an info for validate/inspect, not a loss warned
    # on every restore (tensordict 0.15.3 writes and loads tuples as lists too)
    assert "tuple" not in lost
    infos = [p for p in result.problems if p.code == "json-list"]
    assert [(p.severity, p.key) for p in infos] == [("info", ("tuple",))]
    assert "if it was a tuple it restores as a list" in infos[0].message


def test_stdlib_nan_is_not_lost(tmp_path: Path) -> None:
    target = copy_case(tmp_path, "0.4.0", "non_tensor_lossy")
    with open_storage(target) as storage:
        tree = read_tree(storage)
        result = migrate_tree(tree, storage=storage)
    assert not any("NaN" in line for line in result.lost)
    f_nan = tree.dirs["f_nan"].meta
    assert f_nan is not None and f_nan["data"] != f_nan["data"]  # still NaN


# -- names: the already-robust fast path ---------------------------------------------------


def _names_summary(prefix: Path, robust_key: bool | None) -> tuple[Any, ...]:
    with open_storage(prefix) as storage:
        result = migrate_tree(read_tree(storage), storage=storage)
        names = normalize_names(result.tree, robust_key=robust_key, storage=storage)
        tree = [
            (node.source, [(n, f.source, f.size) for n, f in node.files.items()], list(node.dirs))
            for node in names.tree.walk()
        ]
        return tree, names.problems, names.encoding, names.decisions


@pytest.mark.parametrize("fc", fixture_cases(), ids=case_id)
def test_names_fast_path_agrees_with_the_general_rule(
    fc: FixtureCase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A directory whose keys all have their robust names (and nothing else) skips the
    # general bookkeeping under robust_key=True: it must end exactly as the general rule
    # leaves it (entry order included), with the same problems.
    prefix = copy_case(tmp_path, fc)
    fast = _names_summary(prefix, True)
    monkeypatch.setattr(names_mod, "_already_robust", lambda node, meta: False)
    assert _names_summary(prefix, True) == fast


def test_names_fast_path_is_taken_only_for_exact_robust_directories(tmp_path: Path) -> None:
    from tensordict import TensorDict

    prefix = tmp_path / "ckpt"
    TensorDict({"a b": torch.zeros(2), "n": {"x": torch.ones(2)}}, batch_size=[2]).memmap(prefix)
    with open_storage(prefix) as storage:
        tree = migrate_tree(read_tree(storage), storage=storage).tree
    assert tree.meta is not None
    assert names_mod._already_robust(tree, tree.meta)
    tree.files["stray.memmap"] = VFile("stray.memmap", 1)  # a file no key names
    assert not names_mod._already_robust(tree, tree.meta)
    del tree.files["stray.memmap"]
    tree.files["a b.memmap"] = tree.files.pop("a%20b.memmap")  # the key's file under its raw name
    assert not names_mod._already_robust(tree, tree.meta)
