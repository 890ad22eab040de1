"""Selective restore: ``keys=`` / ``exclude=`` on ``load_memmap`` and the manager's restore."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import copy_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict

import tdckpt
from tdckpt._read.directory import DirectoryStorage
from tdckpt.errors import PickleNotAllowedError, RestoreError


def _td() -> TensorDict:
    return TensorDict(
        model=TensorDict(
            enc=TensorDict(weight=torch.ones(2), bias=torch.zeros(2)),
            dec=TensorDict(weight=torch.full((3,), 2.0)),
        ),
        buffer=TensorDict(obs=torch.arange(8.0).reshape(4, 2), batch_size=[4]),
        step=torch.tensor(5),
    )


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    _td().memmap(tmp_path / "p")
    return tmp_path / "p"


def _leaf_keys(td: Any) -> set[tuple[str, ...]]:
    return {(k,) if isinstance(k, str) else k for k in td.keys(True, True)}


@pytest.fixture
def mapped(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The leaf files every restore maps (both of the directory storage's ways)."""
    seen: list[str] = []
    real_listed, real_map = DirectoryStorage.map_listed, DirectoryStorage.map

    def map_listed(self: DirectoryStorage, specs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend(rel for rel, *_ in specs)
        return real_listed(self, specs, *args, **kwargs)

    def map_one(self: DirectoryStorage, rel: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(rel)
        return real_map(self, rel, *args, **kwargs)

    monkeypatch.setattr(DirectoryStorage, "map_listed", map_listed)
    monkeypatch.setattr(DirectoryStorage, "map", map_one)
    return seen


def test_keys_select_a_subtree_and_only_its_bytes_are_mapped(
    prefix: Path, mapped: list[str]
) -> None:
    out, report = tdckpt.load_memmap(prefix, keys="model", report=True)
    assert _leaf_keys(out) == {
        ("model", "enc", "weight"),
        ("model", "enc", "bias"),
        ("model", "dec", "weight"),
    }
    assert torch.equal(out["model", "dec", "weight"], torch.full((3,), 2.0))
    assert sorted(mapped) == [
        "model/dec/weight.memmap",
        "model/enc/bias.memmap",
        "model/enc/weight.memmap",
    ]
    assert set(report.loaded) == _leaf_keys(out)
    assert set(report.skipped) == {("buffer", "obs"), ("step",)} and report.missing == []
    assert "buffer" not in out.keys()  # noqa: SIM118 (a TensorDict has no 'in')


def test_globs_exclude_and_tuples(prefix: Path) -> None:
    out = tdckpt.load_memmap(prefix, keys=["model.*.weight", ("step",)], exclude="model.dec")
    assert _leaf_keys(out) == {("model", "enc", "weight"), ("step",)}
    out = tdckpt.load_memmap(prefix, exclude=["buffer", "model.enc.b*"])
    assert _leaf_keys(out) == {("model", "enc", "weight"), ("model", "dec", "weight"), ("step",)}
    # batch sizes are kept where a level stays
    assert tdckpt.load_memmap(prefix, keys="buffer")["buffer"].batch_size == torch.Size([4])


def test_a_pattern_that_selects_nothing(prefix: Path) -> None:
    with pytest.raises(
        RestoreError, match=r"select nothing: modle\..*top-level keys: buffer, model, step"
    ):
        tdckpt.load_memmap(prefix, keys=["modle", "step"])
    out, report = tdckpt.load_memmap(prefix, keys=["modle", "step"], strict=False, report=True)
    assert _leaf_keys(out) == {("step",)} and report.missing == [("modle",)]


def test_a_pickled_value_left_out_needs_no_allow_pickle(tmp_path: Path) -> None:
    tdckpt.save(TensorDict(w=torch.ones(2), extra=NonTensorData({1, 2})), tmp_path / "p")
    with pytest.raises(PickleNotAllowedError):
        tdckpt.load_memmap(tmp_path / "p", allow_pickle=False)
    out = tdckpt.load_memmap(tmp_path / "p", allow_pickle=False, exclude="extra")
    assert _leaf_keys(out) == {("w",)}
    with pytest.raises(PickleNotAllowedError):
        tdckpt.load_memmap(tmp_path / "p", allow_pickle=False, keys="extra")


def test_lazy_stacks_apply_the_pattern_to_every_member(tmp_path: Path) -> None:
    stack = LazyStackedTensorDict.lazy_stack(
        [
            TensorDict(a=torch.zeros(2), b=torch.ones(2)),
            TensorDict(a=torch.ones(2), b=torch.zeros(2)),
        ]
    )
    stack.memmap(tmp_path / "s")
    out, report = tdckpt.load_memmap(tmp_path / "s", keys="a", report=True)
    assert isinstance(out, LazyStackedTensorDict) and len(out.tensordicts) == 2
    assert [sorted(m.keys()) for m in out.tensordicts] == [["a"], ["a"]]
    assert torch.equal(out.tensordicts[1]["a"], torch.ones(2))
    assert report.loaded == [("a",)] and report.skipped == [("b",)]


def test_an_old_release_restores_in_part(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.3.2", "nested")
    whole = tdckpt.load_memmap(prefix)
    top = sorted(whole.keys())
    part = tdckpt.load_memmap(prefix, keys=top[0])
    assert sorted(part.keys()) == [top[0]]
    for key in _leaf_keys(part):
        assert torch.equal(part[key], whole[key])


def test_bad_patterns_are_type_errors(prefix: Path) -> None:
    for bad in ("", ("a", ""), 3, ["ok", None]):
        with pytest.raises(TypeError, match="each pattern is a non-empty str"):
            tdckpt.load_memmap(prefix, keys=bad)


def test_manager_restores_one_entry_of_a_training_state(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with tdckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"model": model, "opt": opt})
        part, report = mgr.restore(1, keys="model", report=True)
        assert sorted(part.keys()) == ["model"]
        assert all(k[0] == "opt" for k in report.skipped) and report.skipped
        from tdckpt._state import to_state_dicts

        state = to_state_dicts(part)["model"]
        assert torch.equal(state["weight"], model.weight.detach())
        with pytest.raises(RestoreError, match="select nothing"):
            mgr.restore(1, keys="optimizer")


KEYS = sorted(_leaf_keys(_td()))
NAMES = sorted({name for key in KEYS for name in key} | {"*", "?ec", "x"})


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    keys=st.one_of(
        st.none(),
        st.lists(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3), min_size=1, max_size=3),
    ),
    exclude=st.lists(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3), max_size=2),
)
def test_what_is_restored_is_exactly_what_the_patterns_select(
    tmp_path_factory: pytest.TempPathFactory, keys: Any, exclude: Any
) -> None:
    # The invariant, against a direct reading of the rule: a leaf is restored iff some
    # pattern of keys (or no keys=) names it or a key above it, and no exclude pattern does.
    prefix = tmp_path_factory.mktemp("sel") / "p"
    if not prefix.exists():
        _td().memmap(prefix)
    key_patterns = None if keys is None else [tuple(p) for p in keys]
    ex_patterns = [tuple(p) for p in exclude]

    def covers(p: tuple[str, ...], k: tuple[str, ...]) -> bool:
        return len(p) <= len(k) and all(
            fnmatch.fnmatchcase(n, q) for n, q in zip(k, p, strict=False)
        )

    expected = {
        k
        for k in KEYS
        if (key_patterns is None or any(covers(p, k) for p in key_patterns))
        and not any(covers(p, k) for p in ex_patterns)
    }
    out, report = tdckpt.load_memmap(
        prefix, keys=key_patterns, exclude=ex_patterns or None, strict=False, report=True
    )
    assert _leaf_keys(out) == expected
    assert set(report.loaded) == expected and set(report.skipped) == set(KEYS) - expected
    full = _td()
    for k in expected:
        assert torch.equal(out[k], full[k])


# -- transforms: rename= and dtype= ------------------------------------------------------------


def test_rename_a_subtree_and_cast_floating_leaves(prefix: Path) -> None:
    out = tdckpt.load_memmap(prefix, rename={"model.enc": "encoder"}, dtype=torch.bfloat16)
    assert _leaf_keys(out) == {
        ("encoder", "weight"),
        ("encoder", "bias"),
        ("model", "dec", "weight"),
        ("buffer", "obs"),
        ("step",),
    }
    assert out["encoder", "weight"].dtype == torch.bfloat16
    assert out["step"].dtype == torch.int64  # not floating: not cast
    assert torch.equal(out["model", "dec", "weight"].float(), torch.full((3,), 2.0))
    # compared with a reference built by hand
    ref = _td()
    assert torch.equal(out["buffer", "obs"], ref["buffer", "obs"].to(torch.bfloat16))


def test_regex_renames_and_a_dtype_table(prefix: Path) -> None:
    out = tdckpt.load_memmap(
        prefix,
        rename=[(r"^model\.(\w+)\.weight$", r"weights.\1")],
        dtype={torch.int64: torch.int32},
    )
    assert ("weights", "enc") in _leaf_keys(out) and ("weights", "dec") in _leaf_keys(out)
    assert ("model", "enc", "bias") in _leaf_keys(out)
    assert "dec" not in out["model"].keys()  # noqa: SIM118 (emptied by the moves: gone)
    assert out["step"].dtype == torch.int32 and out["weights", "enc"].dtype == torch.float32


def test_transforms_that_cannot_apply_restore_nothing(prefix: Path, tmp_path: Path) -> None:
    with pytest.raises(RestoreError, match="onto 'buffer'"):
        tdckpt.load_memmap(prefix, rename={"step": "buffer"})
    with pytest.raises(RestoreError, match="maps both"):
        tdckpt.load_memmap(prefix, rename=[(r".*weight$", "w")])
    with pytest.raises(TypeError, match="dtype must be"):
        tdckpt.load_memmap(prefix, dtype="bfloat16")
    with pytest.raises(ValueError, match="not a regex"):
        tdckpt.load_memmap(prefix, rename=[("(", "x")])
    with tdckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _td())
        part = mgr.restore(1, keys="model", rename={"model": "net"}, dtype=torch.float16)
        assert sorted(part.keys()) == ["net"]
        assert part["net", "enc", "weight"].dtype == torch.float16


# -- in place: load_memmap_ / restore_into -----------------------------------------------------


def _target() -> TensorDict:
    return TensorDict(
        model=TensorDict(
            enc=TensorDict(weight=torch.zeros(2), bias=torch.full((2,), 7.0), old=torch.zeros(1)),
            dec=TensorDict(weight=torch.zeros(3)),
        ),
        buffer=TensorDict(obs=torch.zeros(4, 2), batch_size=[4]),
        mine=torch.ones(5),
    )


def test_in_place_replaces_the_selection_and_keeps_everything_else(prefix: Path) -> None:
    target = _target()
    enc, dec, buffer = target["model", "enc"], target["model", "dec"], target["buffer"]
    out, report = tdckpt.load_memmap_(target, prefix, keys="model.enc.w*", report=True)
    assert out is target and target["model", "enc"] is enc  # levels reused
    assert torch.equal(target["model", "enc", "weight"], torch.ones(2))  # selected: replaced
    assert torch.equal(target["model", "enc", "bias"], torch.full((2,), 7.0))  # not selected
    assert "old" in enc.keys() and target["model", "dec"] is dec  # noqa: SIM118
    assert torch.equal(dec["weight"], torch.zeros(3)) and target["buffer"] is buffer
    assert torch.equal(target["mine"], torch.ones(5)) and "step" not in target.keys()  # noqa: SIM118
    assert report.loaded == [("model", "enc", "weight")]


def test_in_place_within_the_selection_the_checkpoint_decides(prefix: Path) -> None:
    target = _target()
    tdckpt.load_memmap_(target, prefix, keys="model.enc")
    # enc.old is inside the selection and not in the checkpoint: removed, as a whole restore
    # would; everything outside the selection stays.
    assert sorted(target["model", "enc"].keys()) == ["bias", "weight"]
    assert torch.equal(target["model", "enc", "bias"], torch.zeros(2))
    assert torch.equal(target["mine"], torch.ones(5))


def test_restore_into_strict_compares_the_selection_only(tmp_path: Path) -> None:
    with tdckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _td())
        target = _target()
        with pytest.raises(RestoreError, match=r"('model', 'enc', 'old')"):  # selected
            mgr.restore_into(target, keys="model.enc")
        assert torch.equal(target["model", "enc", "weight"], torch.zeros(2))  # untouched
        del target["model", "enc", "old"]
        _, report = mgr.restore_into(
            target, keys="model.enc", exclude="model.enc.bias", report=True
        )
        assert torch.equal(target["model", "enc", "weight"], torch.ones(2))
        assert torch.equal(target["model", "enc", "bias"], torch.full((2,), 7.0))  # excluded
        assert torch.equal(target["mine"], torch.ones(5))
        assert report.loaded == [("model", "enc", "weight")]
        with pytest.raises(RestoreError, match="was saved from a TensorDict"):
            mgr.restore_into({"model": torch.nn.Linear(1, 1)}, keys="model")


def test_in_place_failure_leaves_the_target_as_it_was(prefix: Path) -> None:
    target = _target()
    target["buffer"] = TensorDict(obs=torch.zeros(3, 2), batch_size=[3])  # cannot take 4 rows
    before = target.clone()
    with pytest.raises(RestoreError):
        tdckpt.load_memmap_(target, prefix, keys=["model", "buffer"])
    assert (target == before).all()


def test_rename_refuses_what_it_cannot_move(tmp_path: Path) -> None:
    import fixture_types  # noqa: F401 - the saved tensorclass, imported as a user would

    # a tensorclass's fields are fixed by its class: renaming them is refused, nothing returned
    prefix = copy_case(tmp_path, "0.15.3", "tensorclass")
    with pytest.raises(RestoreError, match="cannot move the fields of a tensorclass"):
        tdckpt.load_memmap(prefix, rename={"obs": "observation"}, allow_pickle=True)
    assert tdckpt.load_memmap(prefix, dtype=torch.float16, allow_pickle=True).obs.dtype == (
        torch.float16
    )
    # a checkpoint of a non-tensor value alone: no keys to move
    TensorDict(v=NonTensorData("x")).memmap(tmp_path / "nt")
    out = tdckpt.load_memmap(tmp_path / "nt", rename={"v": "w"})
    assert out["w"] == "x"


# -- in place: what the selection does not select stays ----------------------------------------


def _vals(td: Any) -> dict[tuple[str, ...], list[float]]:
    return {
        (k if isinstance(k, tuple) else (k,)): v.tolist()
        for k, v in td.items(include_nested=True, leaves_only=True)
    }


def test_a_wildcard_pattern_keeps_the_target_entries_it_does_not_select(tmp_path: Path) -> None:
    """keys='*.x' reaches below every top-level name; an entry it reaches below without
    selecting anything there (a leaf 'a') stayed out of the restored part and was DELETED
    from the target, and reported missing. It stays; only m.x is restored."""
    prefix = tmp_path / "ck"
    TensorDict(a=torch.ones(2), m=TensorDict(x=torch.ones(2))).memmap(prefix)
    for strict in (True, False):
        target = TensorDict(
            a=torch.full((2,), 7.0), m=TensorDict(x=torch.zeros(2), y=torch.zeros(2))
        )
        _, report = tdckpt.load_memmap_(target, prefix, keys="*.x", strict=strict, report=True)
        assert _vals(target) == {("a",): [7.0, 7.0], ("m", "x"): [1.0, 1.0], ("m", "y"): [0.0, 0.0]}
        assert report.missing == [] and report.loaded == [("m", "x")]
    with tdckpt.CheckpointManager(tmp_path / "run", fsync=False) as mgr:
        mgr.save(1, TensorDict(a=torch.ones(2), b=torch.ones(2), m=TensorDict(x=torch.ones(2))))
        target = TensorDict(
            a=torch.zeros(2), b=torch.zeros(2), m=TensorDict(x=torch.zeros(2), y=torch.zeros(2))
        )
        mgr.restore_into(target, keys="*.x")  # strict: the step holds every key it concerns
        assert _vals(target) == {
            ("a",): [0.0, 0.0],
            ("b",): [0.0, 0.0],
            ("m", "x"): [1.0, 1.0],
            ("m", "y"): [0.0, 0.0],
        }


def test_a_selected_key_the_checkpoint_lacks_takes_only_itself_away(tmp_path: Path) -> None:
    """keys='m.x', strict=False, a checkpoint whose m lacks x: the target's whole m was
    deleted (m.y with it) and m.x reported missing twice. Only m.x goes, reported once."""
    prefix = tmp_path / "ck"
    TensorDict(a=torch.ones(2), m=TensorDict(z=torch.ones(2))).memmap(prefix)
    target = TensorDict(a=torch.zeros(2), m=TensorDict(x=torch.zeros(2), y=torch.full((2,), 5.0)))
    inner = target["m"]
    _, report = tdckpt.load_memmap_(target, prefix, keys="m.x", strict=False, report=True)
    assert _vals(target) == {("a",): [0.0, 0.0], ("m", "y"): [5.0, 5.0]}
    assert target["m"] is inner  # the target's own nested tensordict, less the key
    assert report.missing == [("m", "x")]
    with pytest.raises(RestoreError, match=r"select nothing: m\.x"):
        tdckpt.load_memmap_(target, prefix, keys="m.x")


def test_overlapping_patterns_select_what_either_selects(tmp_path: Path) -> None:
    """keys=['m', 'm.x']: 'm' restores m whole, which holds m.x; 'm.x' was reported as
    selecting nothing (refused under strict=True)."""
    prefix = tmp_path / "ck"
    TensorDict(a=torch.ones(2), m=TensorDict(x=torch.ones(2), y=torch.ones(2))).memmap(prefix)
    part = tdckpt.load_memmap(prefix, keys=["m", "m.x"])
    assert set(_vals(part)) == {("m", "x"), ("m", "y")}
    target = TensorDict(a=torch.zeros(2), m=TensorDict(x=torch.zeros(2), y=torch.zeros(2)))
    _, report = tdckpt.load_memmap_(target, prefix, keys=["m", "m.x"], report=True)
    assert report.missing == []
    assert _vals(target) == {("a",): [0.0, 0.0], ("m", "x"): [1.0, 1.0], ("m", "y"): [1.0, 1.0]}


def test_regex_renames_move_at_once_and_refuse_a_leaf_over_a_level(tmp_path: Path) -> None:
    """Regex pairs are applied to each key's name at once: a swap (a <-> b) lost one leaf
    silently (renamed one after the other, the second overwrote the first); one key onto a
    level above another's new name (a -> p, b -> p.q) lost a leaf or raised a raw KeyError."""
    prefix = tmp_path / "ck"
    TensorDict(a=torch.ones(2), b=torch.tensor([7, 8]), y=TensorDict(z=torch.zeros(2))).memmap(
        prefix
    )
    out = tdckpt.load_memmap(prefix, rename=[(r"^a$", "TMP"), (r"^b$", "a"), (r"^TMP$", "b")])
    assert _vals(out) == {("a",): [7, 8], ("b",): [1.0, 1.0], ("y", "z"): [0.0, 0.0]}
    assert out["a"].dtype == torch.int64 and out["b"].dtype == torch.float32
    for pairs in ([(r"^a$", "p.q"), (r"^b$", "p")], [(r"^a$", "p"), (r"^y\.z$", "p.q")]):
        with pytest.raises(RestoreError, match=r"rename= maps .* below it .*nothing was restored"):
            tdckpt.load_memmap(prefix, rename=pairs)
