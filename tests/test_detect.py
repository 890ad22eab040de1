"""Generation detection: every fixture case of every release, and the markers one by one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import FixtureCase, case_id, copy_case, fixture_cases

import tdckpt._read.detect as detect_module
from tdckpt._read.detect import (
    Detection,
    class_id_for,
    detect,
    detect_tree,
    gen_name,
    gen_number,
    json_style,
    level_kind,
    parse_type,
    type_name,
)
from tdckpt._read.opener import open_storage
from tdckpt._read.tree import VDir, VFile, read_tree
from tdckpt.errors import UnsupportedFormatError

#: The generation each corpus release belongs to (format-notes.md §7).
RELEASE_GENERATION = {
    "0.2.1": 1,
    "0.3.2": 2,
    "0.4.0": 3,
    "0.8.3": 4,
    "0.12.4": 4,
    "0.13.0": 5,
    "0.14.3": 6,
    "0.15.3": 8,
}

#: Cases whose files pin the detected generation down (the others are honest intervals: e.g.
#: a 0.4.0 TensorDict of leaves only is byte-identical to a 0.3.2 one, and nothing on disk
#: tells 0.14 from 0.15.0/0.15.1).
EXACT = {
    "0.3.2-nested": 2,  # unlisted child collections
    "0.3.2-non_tensor_json": 2,
    "0.3.2-lazy_stack": 2,
    "0.4.0-nested": 3,  # listed children, no is_nested
    "0.4.0-non_tensor_json": 3,
    "0.4.0-lazy_stack": 3,
    "0.14.3-odd_nested__default": 6,  # encoded directory names (and compact JSON)
    "0.14.3-archive_stored": 6,  # .tdz archives exist from 0.14 on
}

TD = "<class 'tensordict._td.TensorDict'>"
NTD = "<class 'tensordict.tensorclass.NonTensorData'>"


def _detect_copy(tmp_path: Path, fc: FixtureCase) -> tuple[Detection, VDir]:
    target = copy_case(tmp_path, fc)
    with open_storage(target) as storage:
        tree = read_tree(storage)
        return detect(tree, storage=storage), tree


@pytest.mark.parametrize("fc", fixture_cases(), ids=case_id)
def test_every_fixture_case(fc: FixtureCase, tmp_path: Path) -> None:
    result, tree = _detect_copy(tmp_path, fc)
    true_gen = RELEASE_GENERATION[fc.version]
    assert result.consistent, result.reasons
    assert result.low <= true_gen <= result.high, (
        f"{fc.id}: written by a G{true_gen} release, detected [G{result.low}, G{result.high}]"
    )
    assert result.generation == gen_name(result.low)  # the oldest consistent generation
    assert all(node.generation == result.generation for node in tree.walk())
    if true_gen in (1, 8):
        assert result.low == result.high == true_gen, fc.id
    if fc.id in EXACT:
        assert result.generation == gen_name(EXACT[fc.id]), fc.id


@pytest.mark.parametrize("fc", fixture_cases(), ids=case_id)
def test_fast_path_for_marked_trees_agrees_with_the_evidence(
    fc: FixtureCase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Trees whose every directory says "_format_version": 1 skip the evidence: the result
    # (and every directory's generation) must be what weighing the evidence gives.
    fast, fast_tree = _detect_copy(tmp_path / "fast", fc)
    monkeypatch.setattr(detect_module, "_marked_current", lambda root: None)
    slow, slow_tree = _detect_copy(tmp_path / "slow", fc)

    def summary(d: Detection, tree: VDir) -> tuple[object, ...]:
        nodes = list(tree.walk())  # styles are keyed by id(): compare them in tree order
        return (d.generation, d.low, d.high, d.consistent, d.reasons,
                [d.styles.get(id(n)) for n in nodes], [n.generation for n in nodes])  # fmt: skip

    assert summary(fast, fast_tree) == summary(slow, slow_tree)


def test_fast_path_is_taken_for_a_current_tree(tmp_path: Path) -> None:
    (fc,) = fixture_cases(versions=["0.15.3"], where=lambda c: c.name == "nested")
    target = copy_case(tmp_path, fc)
    with open_storage(target) as storage:
        tree = read_tree(storage)
    marked = detect_module._marked_current(tree)
    assert marked is not None and len(marked) == len(list(tree.walk())) > 1
    tree.dirs[next(iter(tree.dirs))].meta.pop("_format_version")  # one unmarked level
    assert detect_module._marked_current(tree) is None


@pytest.mark.parametrize("fc", fixture_cases(versions=["0.8.3", "0.13.0"]), ids=case_id)
def test_compact_json_narrows_to_orjson_era(fc: FixtureCase, tmp_path: Path) -> None:
    result, _tree = _detect_copy(tmp_path, fc)
    assert (result.low, result.high) == (4, 7)
    assert "compact" in result.styles.values()


def test_without_storage_uses_parsed_metadata_only(tmp_path: Path) -> None:
    (fc,) = fixture_cases(versions=["0.15.3"], where=lambda c: c.name == "nested")
    target = copy_case(tmp_path, fc)
    with open_storage(target) as storage:
        tree = read_tree(storage)
    assert detect_tree(tree) == "G8"
    assert {n.generation for n in tree.walk()} == {"G8"}


# -- markers, one by one ---------------------------------------------------------------------


def _td(entries: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {**(entries or {}), "shape": [3], "device": "cpu", "_type": TD, **fields}


def _leaf(**extra: Any) -> dict[str, Any]:
    return {"device": "cpu", "shape": [3], "dtype": "torch.float32", **extra}


def _tree(meta: dict[str, Any], **dirs: VDir) -> VDir:
    files = {
        f"{k}.memmap": VFile(source=f"{k}.memmap", size=12)
        for k, v in meta.items()
        if isinstance(v, dict) and "dtype" in v
    }
    return VDir(source="", meta=meta, files=files, dirs=dict(dirs))


def test_g0_refused() -> None:
    with pytest.raises(UnsupportedFormatError, match="not migratable: no shapes or dtypes"):
        detect_tree(VDir(source="", files={"ckpttmp1a2b": VFile("ckpttmp1a2b", 8)}))


def test_newer_format_refused() -> None:
    tree = _tree(
        _td({"a": _leaf(is_nested=False)}, _format_version=2, _class="tensordict:TensorDict")
    )
    with pytest.raises(
        UnsupportedFormatError,
        match=r"written by a newer tensordict format \(2\); this tdckpt reads up to 1: "
        r"upgrade tdckpt",
    ):
        detect_tree(tree)


def test_newer_format_refused_below_the_root() -> None:
    child = VDir(source="s", meta=_td(_format_version=5, _class="tensordict:TensorDict"))
    tree = _tree(
        _td({"s": {"type": "TensorDict"}}, _format_version=1, _class="tensordict:TensorDict"),
        s=child,
    )
    with pytest.raises(UnsupportedFormatError, match=r"format \(5\)") as err:
        detect_tree(tree)
    assert err.value.format_version == 5


def test_key_named_format_version_still_g8() -> None:
    # 0.15.3 keeps the leaf entry of a key named "_format_version" (the file "reads as
    # version 0"), but it still writes _class: that is enough.
    meta = _td({"_format_version": _leaf(is_nested=False)}, _class="tensordict:TensorDict")
    assert detect_tree(_tree(meta)) == "G8"


def test_unmarked_levels_of_a_g8_tree() -> None:
    ntd = VDir(
        source="s", meta={"_type": NTD, "data": "x", "_metadata": None, "_is_non_tensor": True}
    )
    inner = VDir(
        source="tc/_tensordict",
        meta=_td({"x": _leaf(is_nested=False)}, _format_version=1, _class="tensordict:TensorDict"),
    )
    tc = VDir(source="tc", meta={"_type": "<class 'mod.TC'>"}, dirs={"_tensordict": inner})
    root = _tree(
        _td(
            {"s": {"type": "NonTensorData"}, "tc": {"type": "TC"}},
            _format_version=1,
            _class="tensordict:TensorDict",
        ),
        s=ntd,
        tc=tc,
    )
    assert detect_tree(root) == "G8"
    assert ntd.generation == tc.generation == "G8"
    # a tensorclass at the root: the marker of its _tensordict decides
    tc_root = VDir(source="", meta={"_type": "<class 'mod.TC'>"}, dirs={"_tensordict": inner})
    assert detect_tree(tc_root) == "G8"


def test_g1_meta_pt() -> None:
    tree = VDir(source="", pt={"meta.pt": {"batch_size": (3,), "device": None}})
    assert detect_tree(tree) == "G1"


def test_g2_unlisted_children_and_g3_listed() -> None:
    child = VDir(source="n", meta=_td({"x": _leaf()}))
    g2 = _tree(_td({"a": _leaf()}), n=child)
    assert detect(g2).generation == "G2" and detect(g2).high == 2
    child = VDir(source="n", meta=_td({"x": _leaf()}))
    g3 = _tree(_td({"a": _leaf(), "n": {"type": "TensorDict"}}), n=child)
    result = detect(g3)
    assert (result.generation, result.low, result.high) == ("G3", 3, 3)


def test_nontensordata_tensordict_subdir_means_g2_g3() -> None:
    ntd = VDir(
        source="s",
        meta={"_type": NTD, "data": 1, "_metadata": None, "_is_non_tensor": True},
        dirs={"_tensordict": VDir(source="s/_tensordict", meta=_td())},
    )
    result = detect(_tree(_td({"s": {"type": "NonTensorData"}}), s=ntd))
    assert (result.low, result.high) == (3, 3)


def test_json_types_means_g7() -> None:
    ntd = VDir(
        source="s",
        meta={"_type": NTD, "_metadata": None, "_is_non_tensor": True},
        files={
            "other.pickle": VFile("s/other.pickle", 30),
            "json_types.json": VFile("s/json_types.json", 90),
        },
    )
    result = detect(
        _tree(_td({"x": _leaf(is_nested=False), "s": {"type": "NonTensorData"}}), s=ntd)
    )
    assert (result.generation, result.low, result.high) == ("G7", 7, 7)


def test_encoded_dirs_mean_g6_and_encoded_leaves_with_raw_dirs_g4_g5() -> None:
    sub = VDir(source="sub%20dir", meta=_td({"x": _leaf(is_nested=False)}))
    g6 = _tree(_td({"sub dir": {"type": "TensorDict"}}), **{"sub%20dir": sub})
    assert detect(g6).low == 6
    meta = _td({"a b": _leaf(is_nested=False), "sub dir": {"type": "TensorDict"}})
    g5 = VDir(
        source="",
        meta=meta,
        files={"a%20b.memmap": VFile("a%20b.memmap", 12)},
        dirs={"sub dir": VDir(source="sub dir", meta=_td({"x": _leaf(is_nested=False)}))},
    )
    result = detect(g5)
    assert (result.low, result.high) == (4, 5)


def test_encoded_dir_of_a_key_with_a_slash_means_g6() -> None:
    # tensordict 0.14 names the directory of the key "sub dir/.." "sub%20dir%2F..": a raw
    # (0.5 - 0.13) writer would have nested it, so the encoded name alone pins 0.14+
    sub = VDir(source="sub%20dir%2F..", meta=_td({"x": _leaf(is_nested=False)}))
    tree = VDir(
        source="",
        meta=_td({"a b": _leaf(is_nested=False), "sub dir/..": {"type": "TensorDict"}}),
        files={"a%20b.memmap": VFile("a%20b.memmap", 12)},
        dirs={"sub%20dir%2F..": sub},
    )
    assert detect(tree).low == 6


def test_upgrade_keeps_a_0_14_child_whose_key_holds_a_slash(tmp_path: Path) -> None:
    # regression: such a tensordict 0.14.3 tree passed for G4, and the upgrade dropped the
    # child as "lost by the writer" though it was stored (tests/test_save.py odd_keys case)
    import torch

    import tdckpt

    root = tmp_path / "ckpt"
    sub = root / "sub%20dir%2F.."
    sub.mkdir(parents=True)
    leaf = {"device": "cpu", "shape": [3], "dtype": "torch.float32", "is_nested": False}
    meta = {"a b": leaf, "sub dir/..": {"type": "TensorDict"}, "shape": [3], "device": "cpu"}
    (root / "meta.json").write_text(json.dumps({**meta, "_type": TD}, separators=(",", ":")))
    (sub / "meta.json").write_text(
        json.dumps({"x": leaf, "shape": [3], "device": "cpu", "_type": TD}, separators=(",", ":"))
    )
    (root / "a%20b.memmap").write_bytes(torch.arange(3.0).numpy().tobytes())
    (sub / "x.memmap").write_bytes(torch.ones(3).numpy().tobytes())
    report = tdckpt.upgrade(root, backup=False)
    assert "G6 -> G8" in str(report), str(report)
    td = tdckpt.load_memmap(root)
    assert torch.equal(td["sub dir/..", "x"], torch.ones(3))
    assert torch.equal(td["a b"], torch.arange(3.0))


def test_tensorclass_subclass_bug_means_g4_g5() -> None:
    # 0.10-0.13 saved a TensorClass-subclass instance as a plain TensorDict
    child = VDir(source="tc", meta=_td({"x": _leaf(is_nested=False)}))
    tree = _tree(_td({"tc": {"type": "MyTC"}}), tc=child)
    result = detect(tree)
    assert (result.low, result.high) == (4, 5)


def test_disagreeing_directories_fall_back_per_directory() -> None:
    old = VDir(source="old", meta=_td({"x": _leaf()}))  # no is_nested: <= G3
    root = _tree(
        _td({"old": {"type": "TensorDict"}}, _format_version=1, _class="tensordict:TensorDict"),
        old=old,
    )
    result = detect(root)
    assert not result.consistent
    assert root.generation == "G8"
    assert old.generation == "G2"  # its own oldest consistent generation


def test_archive_means_at_least_g6(tmp_path: Path) -> None:
    (fc,) = fixture_cases(versions=["0.14.3"], where=lambda c: c.name == "archive_deflate")
    result, _tree = _detect_copy(tmp_path, fc)
    assert result.low == 6


def test_detection_reads_nothing_but_metadata(tmp_path: Path) -> None:
    (fc,) = fixture_cases(versions=["0.8.3"], where=lambda c: c.name == "flat")
    target = copy_case(tmp_path, fc)
    for leaf in target.glob("*.memmap"):
        leaf.chmod(0)  # unreadable: detection must not need leaf bytes
    with open_storage(target) as storage:
        assert detect(read_tree(storage), storage=storage).generation == "G4"


# -- helpers ----------------------------------------------------------------------------------


def test_helpers() -> None:
    assert gen_name(3) == "G3" and gen_number("G7") == 7
    with pytest.raises(ValueError, match="not a generation"):
        gen_number("7")
    assert parse_type("nope") is None
    assert type_name({"_class": "tensordict._td:_SubTensorDict"}) == "_SubTensorDict"
    assert class_id_for({"_type": TD}) == "tensordict:TensorDict"
    assert (
        class_id_for({"_type": "<class 'tensordict._td._SubTensorDict'>"})
        == "tensordict._td:_SubTensorDict"
    )
    assert class_id_for({"_type": "<class 'fixture_types.FixtureTC'>"}) == "fixture_types:FixtureTC"
    kinds = {
        "lazy-stack": {"_type": "<class 'tensordict._lazy.LazyStackedTensorDict'>", "stack_dim": 0},
        "non-tensor-stack": {
            "_type": "<class 'tensordict.tensorclass.NonTensorStack'>",
            "data": [],
        },
        "non-tensor": {"_type": "<class 'tensordict.tensorclass.MetaData'>", "data": 1},
        "sub-tensordict": {"_type": "<class 'tensordict._td._SubTensorDict'>", "index": 0},
        "lazy-view": {**_td(), "custom_op": "unsqueeze", "inv_op": "squeeze"},
        "tensorclass": {"_type": "<class 'm.C'>", "label": "x"},
        "unknown": {"x": 1},
    }
    for kind, meta in kinds.items():
        assert level_kind(meta) == kind, kind
    assert json_style(json.dumps({"ü": 1}, ensure_ascii=False).encode()) == "spaced"
    assert json_style(b'{"a\\"b":1}') == "compact"
    assert json_style(b"[1]") is None
