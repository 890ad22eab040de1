"""All or nothing: every way a restore can fail leaves the target exactly as it was.

For each failure path - a damaged checkpoint, a target that cannot take it, a pickle that may
not be loaded, bad arguments, and an exception injected while the swap is being committed -
``tdckpt.load_memmap_`` raises a :class:`~tdckpt.errors.TdckptError` subclass (``TypeError`` /
``ValueError`` for bad arguments), and afterwards the target has:

* the same keys at every level, the very same nested objects and leaf tensor objects,
  with the same values (raw bytes);
* the same batch size, lock state, ``is_memmap()`` and ``_memmap_prefix`` at every level,
  NonTensorData included;

and the checkpoint directory is byte for byte unchanged. tensordict 0.15.3 fails most of these
half-way (format-notes.md §4.3: leaves already replaced, stale keys kept, lock released).
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _restore_helpers import diff_states, make_target, objects, reference, state
from conftest import tree_digest

tensordict = pytest.importorskip("tensordict")

import fixture_types  # noqa: E402
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, tensorclass  # noqa: E402

import tdckpt  # noqa: E402
from tdckpt.errors import (  # noqa: E402
    CheckpointNotFoundError,
    PickleNotAllowedError,
    RestoreError,
    TdckptError,
    UnsupportedFormatError,
    ValidationError,
)

# ------------------------------------------------------------------------------ the checkpoint


def saved_td() -> TensorDict:
    """Three levels, several dtypes, a non-tensor value; batch size [4]."""
    td = TensorDict(
        a=torch.arange(4.0),
        b=torch.arange(8).reshape(4, 2),
        n=TensorDict(
            c=torch.arange(12.0).reshape(4, 3),
            deep=TensorDict(d=torch.arange(4, dtype=torch.int16), batch_size=[4]),
            batch_size=[4],
        ),
        batch_size=[4],
    )
    td.set_non_tensor("s", "hello")
    return td


def write(prefix: Path, td: Any) -> Path:
    with reference():
        td.memmap(prefix)
    return prefix


def edit_json(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


# --------------------------------------------------------------------------- the "before" state


@dataclass
class Before:
    objs: dict[tuple[Any, ...], Any]
    state: Any
    digest: dict[str, str]
    own_digest: dict[str, str]


def _roots(prefix: Path, own: Path | None) -> list[tuple[Path, str]]:
    return [(prefix, "<ckpt>")] + ([(own, "<own>")] if own is not None else [])


def capture(target: Any, prefix: Path, own: Path | None = None) -> Before:
    return Before(
        objects(target),
        state(target, *_roots(prefix, own)),
        tree_digest(prefix) if prefix.exists() else {},
        tree_digest(own) if own is not None else {},
    )


def assert_unchanged(target: Any, before: Before, prefix: Path, own: Path | None = None) -> None:
    now = objects(target)
    assert now.keys() == before.objs.keys(), "keys differ"
    replaced = [p for p, obj in before.objs.items() if now[p] is not obj]
    assert replaced == [], f"objects replaced at {replaced}"
    # values (raw bytes), dtypes, shapes, batch sizes, classes, lock/memmap state, prefixes
    differences = diff_states(state(target, *_roots(prefix, own)), before.state)
    assert not differences, "the target changed (now != before):\n" + "\n".join(differences)
    if prefix.exists():
        assert tree_digest(prefix) == before.digest, "the checkpoint was written to"
    if own is not None:
        assert tree_digest(own) == before.own_digest, "the target's own files changed"


def make(kind: str, tmp_path: Path, content: Any | None = None) -> tuple[Any, Path | None]:
    """A target shaped like ``content`` (default: :func:`saved_td`): fresh or memmapped+locked."""
    target = make_target(saved_td() if content is None else content)
    own = None
    if kind == "memmapped":
        own = tmp_path / "own"
        with reference():
            target.memmap_(own)
        assert target.is_locked and target.is_memmap()
    return target, own


# ---------------------------------------------------------------------- damaged checkpoints

CORRUPTIONS: dict[str, tuple[Callable[[Path], Any], type[BaseException], str]] = {
    "truncated-leaf": (
        lambda p: (p / "a.memmap").write_bytes((p / "a.memmap").read_bytes()[:6]),
        ValidationError,
        r"a\.memmap \[a\]: 6 bytes, but torch\.float32 \[4\] needs 16",
    ),
    "empty-leaf": (
        lambda p: (p / "n" / "c.memmap").write_bytes(b""),
        ValidationError,
        r"n/c\.memmap \[n\.c\]: 0 bytes",
    ),
    "missing-leaf": (
        lambda p: (p / "n" / "c.memmap").unlink(),
        ValidationError,
        r"n/c\.memmap \[n\.c\]: the data file is missing",
    ),
    "unknown-dtype": (
        lambda p: edit_json(p / "n" / "meta.json", lambda m: m["c"].update(dtype="torch.float33")),
        ValidationError,
        r"dtype 'torch\.float33' is not a torch dtype",
    ),
    "wider-dtype": (
        lambda p: edit_json(p / "meta.json", lambda m: m["a"].update(dtype="torch.float64")),
        ValidationError,
        r"a\.memmap \[a\]: 16 bytes, but torch\.float64 \[4\] needs 32",
    ),
    "leaf-shape-vs-batch": (
        lambda p: edit_json(p / "meta.json", lambda m: m["a"].update(shape=[2])),
        ValidationError,
        r"shape \[2\] does not start with the batch size \[4\]",
    ),
    "corrupt-nested-meta": (
        lambda p: (p / "n" / "deep" / "meta.json").write_text('{"d": {'),
        ValidationError,
        r"n/deep/meta\.json.*not valid JSON",
    ),
    "corrupt-root-meta": (
        lambda p: (p / "meta.json").write_text('{"a": '),
        ValidationError,
        r"meta\.json.*not valid JSON",
    ),
    "missing-root-meta": (
        lambda p: (p / "meta.json").unlink(),
        CheckpointNotFoundError,
        r"not a tensordict checkpoint",
    ),
    "missing-child": (
        lambda p: shutil.rmtree(p / "n" / "deep"),
        ValidationError,
        r"n/deep \[n\.deep\]: meta\.json lists a nested TensorDict under this key, but its "
        r"directory is missing",
    ),
    "missing-non-tensor-meta": (
        lambda p: (p / "s" / "meta.json").unlink(),
        ValidationError,
        r"s/meta\.json \[s\]: missing",
    ),
    "format-version-2": (
        lambda p: edit_json(p / "meta.json", lambda m: m.update(_format_version=2)),
        UnsupportedFormatError,
        r"format \(?2\)?.*reads up to 1",
    ),
    "nested-format-version-2": (
        lambda p: edit_json(p / "n" / "meta.json", lambda m: m.update(_format_version=2)),
        UnsupportedFormatError,
        r"n/meta\.json.*format \(?2\)?",
    ),
    "unknown-class": (
        # the class as the installed writer records it: _type, and _class where it writes one
        # (0.15.3+; a 0.14 meta.json with _class but no _format_version would be another error)
        lambda p: edit_json(
            p / "n" / "meta.json",
            lambda m: m.update(
                _type="<class 'foo.Bar'>", **({"_class": "foo:Bar"} if "_class" in m else {})
            ),
        ),
        ValidationError,
        r"_class 'foo:Bar' is not a tensordict class",
    ),
}


@pytest.mark.parametrize("mode", [None, "r"], ids=["mode=None", "mode=r"])
@pytest.mark.parametrize("kind", ["fresh", "memmapped"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_damaged_checkpoint_changes_nothing(
    corruption: str, kind: str, mode: str | None, tmp_path: Path
) -> None:
    damage, error, match = CORRUPTIONS[corruption]
    prefix = write(tmp_path / "ckpt", saved_td())
    damage(prefix)
    target, own = make(kind, tmp_path)
    before = capture(target, prefix, own)

    with pytest.raises(error, match=match) as info:
        tdckpt.load_memmap_(target, prefix, allow_pickle=True, mode=mode)

    assert isinstance(info.value, TdckptError)
    assert_unchanged(target, before, prefix, own)
    # tdckpt.load_memmap refuses the same checkpoint the same way
    with pytest.raises(error, match=match):
        tdckpt.load_memmap(prefix, allow_pickle=True, mode=mode)


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_error_names_the_prefix(corruption: str, tmp_path: Path) -> None:
    """Design contract: every message names the prefix (and the key/file, what was found)."""
    damage, error, _ = CORRUPTIONS[corruption]
    prefix = write(tmp_path / "ckpt", saved_td())
    damage(prefix)
    with pytest.raises(error) as info:
        tdckpt.load_memmap_(make("fresh", tmp_path)[0], prefix, allow_pickle=True)
    assert str(prefix) in str(info.value)
    if isinstance(info.value, ValidationError):
        assert "nothing was changed" in str(info.value)
        assert f"tdckpt validate {prefix}" in str(info.value)
        assert info.value.report.problems, "the report lists the problems"


def test_every_problem_is_listed_at_once(tmp_path: Path) -> None:
    prefix = write(tmp_path / "ckpt", saved_td())
    for name in ("truncated-leaf", "missing-child", "unknown-dtype"):
        CORRUPTIONS[name][0](prefix)
    target, _ = make("fresh", tmp_path)
    before = capture(target, prefix)
    with pytest.raises(ValidationError, match=r"3 problem\(s\)") as info:
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert {"a.memmap", "n/deep", "n/meta.json"} <= {p.path for p in info.value.report.problems}
    assert_unchanged(target, before, prefix)


def test_corrupt_pickle_changes_nothing(tmp_path: Path) -> None:
    """A pickle that cannot be loaded fails while preparing, before the target is touched."""
    td = saved_td()
    td.set_non_tensor("p", fixture_types.Point(1, 2))
    prefix = write(tmp_path / "ckpt", td)
    (prefix / "p" / "other.pickle").write_bytes(b"\x80\x05garbage")
    content = saved_td()
    content.set_non_tensor("p", fixture_types.Point(0, 0))
    target, _ = make("fresh", tmp_path, content)
    before = capture(target, prefix)
    with pytest.raises(RestoreError, match=r"p/other\.pickle: the pickled value cannot be loaded"):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert_unchanged(target, before, prefix)


# ------------------------------------------------------------------ targets that cannot take it


@pytest.mark.parametrize("kind", ["fresh", "memmapped"])
def test_batch_mismatch_with_the_target(kind: str, tmp_path: Path) -> None:
    """tensordict accepts it and leaves batch [5] with leaves of 4 rows (format-notes §4.2)."""
    prefix = write(tmp_path / "ckpt", saved_td())
    content = TensorDict(
        a=torch.zeros(5), n=TensorDict(c=torch.zeros(5, 3), batch_size=[5]), batch_size=[5]
    )
    target, own = make(kind, tmp_path, content)
    before = capture(target, prefix, own)
    with pytest.raises(RestoreError, match=r"batch size \[5\]") as info:
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert info.value.expected == [5] and info.value.found[:1] == [4]
    assert_unchanged(target, before, prefix, own)


def test_nested_batch_mismatch_with_the_target(tmp_path: Path) -> None:
    """The root fits, a nested level does not: found while preparing, nothing swapped."""
    prefix = write(tmp_path / "ckpt", saved_td())
    target = TensorDict(
        a=torch.zeros(4),
        n=TensorDict(deep=TensorDict(batch_size=[4, 1]), batch_size=[4, 1]),
        batch_size=[4],
    )
    before = capture(target, prefix)
    with pytest.raises(RestoreError, match=r"batch size \[4, 1\]"):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert_unchanged(target, before, prefix)


def _stack(n: int) -> LazyStackedTensorDict:
    return LazyStackedTensorDict(
        *[TensorDict(x=torch.full((2, i + 1), float(i)), batch_size=[2]) for i in range(n)],
        stack_dim=0,
    )


@pytest.mark.parametrize("kind", ["fresh", "memmapped"])
def test_lazy_stack_member_count_mismatch(kind: str, tmp_path: Path) -> None:
    prefix = write(tmp_path / "ckpt", _stack(2))
    target, own = make(kind, tmp_path, _stack(3))
    before = capture(target, prefix, own)
    with pytest.raises(RestoreError, match=r"cannot load 2 stacked tensordicts into a stack of 3"):
        tdckpt.load_memmap_(target, prefix)
    assert_unchanged(target, before, prefix, own)


def test_lazy_stack_checkpoint_into_a_tensordict(tmp_path: Path) -> None:
    prefix = write(tmp_path / "ckpt", _stack(2))
    target = TensorDict(x=torch.zeros(2, 2), batch_size=[2])
    before = capture(target, prefix)
    with pytest.raises(
        RestoreError, match="lazy stack of 2 tensordicts, the target is a TensorDict"
    ):
        tdckpt.load_memmap_(target, prefix)
    assert_unchanged(target, before, prefix)


def test_lazy_stack_dim_mismatch(tmp_path: Path) -> None:
    prefix = write(tmp_path / "ckpt", _stack(2))
    target = LazyStackedTensorDict(
        *[TensorDict(x=torch.zeros(2, 1), batch_size=[2]) for _ in range(2)], stack_dim=1
    )
    before = capture(target, prefix)
    with pytest.raises(
        RestoreError,
        match=r"stacks its 2 tensordicts along dim 0, the target's lazy stack along dim 1",
    ):
        tdckpt.load_memmap_(target, prefix)
    assert_unchanged(target, before, prefix)


@tensorclass
class OtherTC:
    obs: torch.Tensor
    reward: torch.Tensor
    label: str
    extra: Any


def _tc(cls: type, batch: int = 3) -> Any:
    return cls(
        obs=torch.ones(batch, 2),
        reward=torch.zeros(batch),
        label="x",
        extra="more",
        batch_size=[batch],
    )


@pytest.mark.parametrize("kind", ["fresh", "memmapped"])
def test_tensorclass_class_mismatch(kind: str, tmp_path: Path) -> None:
    prefix = write(tmp_path / "ckpt", _tc(fixture_types.FixtureTC))
    target, own = make(kind, tmp_path, _tc(OtherTC))
    before = capture(target, prefix, own)
    with pytest.raises(
        RestoreError, match=r"holds <class 'fixture_types\.FixtureTC'>, the target is .*OtherTC"
    ):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert_unchanged(target, before, prefix, own)


def test_tensorclass_checkpoint_into_a_tensordict(tmp_path: Path) -> None:
    prefix = write(tmp_path / "ckpt", _tc(fixture_types.FixtureTC))
    target = TensorDict(obs=torch.zeros(3, 2), batch_size=[3])
    before = capture(target, prefix)
    with pytest.raises(
        RestoreError,
        match=r"tensorclass <class 'fixture_types\.FixtureTC'>, the target is a TensorDict",
    ):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert_unchanged(target, before, prefix)


def test_nested_tensorclass_not_imported(tmp_path: Path) -> None:
    """The saved class cannot be resolved (tdckpt never imports modules named by a file)."""
    td = TensorDict(a=torch.zeros(3), batch_size=[3])
    td["tc"] = _tc(fixture_types.FixtureTC)
    prefix = write(tmp_path / "ckpt", td)
    edit_json(
        prefix / "tc" / "meta.json", lambda m: m.update(_type="<class 'not_imported_mod.Gone'>")
    )
    target = TensorDict(a=torch.ones(3), other=torch.ones(3), batch_size=[3])
    before = capture(target, prefix)
    with pytest.raises(RestoreError, match=r"not_imported_mod\.Gone is not imported"):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert_unchanged(target, before, prefix)


@pytest.mark.parametrize("level", ["root", "nested"])
def test_locked_non_memmapped_target(level: str, tmp_path: Path) -> None:
    prefix = write(tmp_path / "ckpt", saved_td())
    target, _ = make("fresh", tmp_path)
    (target if level == "root" else target["n"]).lock_()
    before = capture(target, prefix)
    with pytest.raises(RestoreError, match=r"locked \(and not memory-mapped\).*td\.unlock_\(\)"):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert_unchanged(target, before, prefix)


@pytest.mark.parametrize("kind", ["fresh", "memmapped"])
def test_pickle_under_allow_pickle_false(kind: str, tmp_path: Path) -> None:
    td = saved_td()
    td.set_non_tensor("p", fixture_types.Point(1, 2))
    prefix = write(tmp_path / "ckpt", td)
    content = saved_td()
    content.set_non_tensor("p", fixture_types.Point(0, 0))
    target, own = make(kind, tmp_path, content)
    before = capture(target, prefix, own)
    with pytest.raises(PickleNotAllowedError, match=r"p \(p/other\.pickle\)"):
        tdckpt.load_memmap_(target, prefix, allow_pickle=False)
    assert_unchanged(target, before, prefix, own)


# ------------------------------------------------------------------------------ bad arguments

BAD_ARGUMENTS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "allow_pickle='False'": (
        {"allow_pickle": "False"},
        TypeError,
        "allow_pickle must be a bool or None",
    ),
    # tensordict's own TypeError wording (its test_memmap_pickle_policy_requires_bool)
    "allow_pickle=0": ({"allow_pickle": 0}, TypeError, "allow_pickle must be a bool or None"),
    "allow_pickle=1": (
        {"allow_pickle": 1},
        TypeError,
        r"must be a bool or None .*\(builtins\.int\)",
    ),
    "allow_pickle=np.True_": (
        {"allow_pickle": np.True_},
        TypeError,
        r"allow_pickle must be a bool or None .*\(numpy\.bool",
    ),
    "mode='w'": ({"mode": "w"}, ValueError, "mode must be 'r', 'r\\+' or None"),
    "mode='rb'": ({"mode": "rb"}, ValueError, "mode must be"),
    "robust_key='yes'": (
        {"robust_key": "yes"},
        TypeError,
        "robust_key must be True, False or None",
    ),
    "robust_key=1": ({"robust_key": 1}, TypeError, "robust_key must be"),
}


@pytest.mark.parametrize("kind", ["fresh", "memmapped"])
@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments(case: str, kind: str, tmp_path: Path) -> None:
    kwargs, error, match = BAD_ARGUMENTS[case]
    prefix = write(tmp_path / "ckpt", saved_td())
    target, own = make(kind, tmp_path)
    before = capture(target, prefix, own)
    with pytest.raises(error, match=match):
        tdckpt.load_memmap_(target, prefix, **kwargs)
    assert_unchanged(target, before, prefix, own)
    with pytest.raises(error, match=match):
        tdckpt.load_memmap(prefix, **kwargs)


def test_missing_prefix(tmp_path: Path) -> None:
    target, _ = make("fresh", tmp_path)
    before = capture(target, tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError):
        tdckpt.load_memmap_(target, tmp_path / "nope")
    assert_unchanged(target, before, tmp_path / "nope")


# ------------------------------------------------- exceptions injected while committing


class Injected(Exception):
    pass


@pytest.fixture
def fail_on_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[Path, int, type[BaseException]], list[Any]]:
    """Make the n-th assignment of a memmap prefix inside ``ckpt`` raise (commit phase).

    tdckpt assigns the loaded directory to each level's ``_memmap_prefix`` only while
    committing, after it has swapped the levels' items, so the injected error lands in the
    middle of the commit; the rollback must undo every swap already made.
    """

    def arm(ckpt: Path, nth: int, exc: type[BaseException] = Injected) -> list[Any]:
        seen: list[Any] = []

        def get(self: Any) -> Any:
            return self.__dict__.get("_memmap_prefix")

        def set_(self: Any, value: Any) -> None:
            if value is not None and str(value).startswith(str(ckpt)):
                seen.append(value)
                if len(seen) == nth:
                    raise exc(f"injected at {value}")
            self.__dict__["_memmap_prefix"] = value

        monkeypatch.setattr(TensorDict, "_memmap_prefix", property(get, set_))
        return seen

    return arm


@pytest.mark.parametrize("exc", [Injected, KeyboardInterrupt])
@pytest.mark.parametrize("nth", [1, 3])
@pytest.mark.parametrize("kind", ["fresh", "memmapped"])
def test_rollback_when_commit_fails(
    kind: str, nth: int, exc: type[BaseException], tmp_path: Path, fail_on_prefix: Any
) -> None:
    prefix = write(tmp_path / "ckpt", saved_td())
    target, own = make(kind, tmp_path)
    before = capture(target, prefix, own)
    seen = fail_on_prefix(prefix, nth, exc)
    with pytest.raises(exc, match="injected"):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert len(seen) == nth, "the failure was injected while committing"
    assert_unchanged(target, before, prefix, own)
    # and the same target restores fine afterwards
    seen.clear()
    fail_on_prefix(prefix, 10**6)
    tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert target["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and target["s"] == "hello"
    assert target.is_locked == (kind == "memmapped")


def test_rollback_when_relocking_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last step of a memory-mapped restore (lock_) fails: everything is put back."""
    prefix = write(tmp_path / "ckpt", saved_td())
    target, own = make("memmapped", tmp_path)
    before = capture(target, prefix, own)
    original = TensorDictBase.lock_
    calls: list[Any] = []

    def lock_(self: Any) -> Any:
        calls.append(self)
        if len(calls) == 1:
            raise Injected("injected in lock_")
        return original(self)

    monkeypatch.setattr(TensorDictBase, "lock_", lock_)
    with pytest.raises(Injected):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert calls and calls[0] is target
    assert_unchanged(target, before, prefix, own)


def test_rollback_of_a_tensorclass_target(tmp_path: Path, fail_on_prefix: Any) -> None:
    """Non-tensor fields and the inner TensorDict are put back too."""
    prefix = write(tmp_path / "ckpt", _tc(fixture_types.FixtureTC))
    target, own = make("memmapped", tmp_path, _tc(fixture_types.FixtureTC))
    before = capture(target, prefix, own)
    fail_on_prefix(prefix, 2)
    with pytest.raises(Injected):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert_unchanged(target, before, prefix, own)


def test_rollback_of_a_lazy_stack_target(tmp_path: Path, fail_on_prefix: Any) -> None:
    prefix = write(tmp_path / "ckpt", _stack(3))
    target, own = make("memmapped", tmp_path, _stack(3))
    before = capture(target, prefix, own)
    fail_on_prefix(prefix, 2)
    with pytest.raises(Injected):
        tdckpt.load_memmap_(target, prefix)
    assert_unchanged(target, before, prefix, own)


def test_tensordict_itself_is_not_all_or_nothing(tmp_path: Path) -> None:
    """Why this file exists: tensordict half-loads on a corrupted nested meta.json (§4.3)."""
    prefix = write(tmp_path / "ckpt", saved_td())
    CORRUPTIONS["corrupt-nested-meta"][0](prefix)
    target, _ = make("memmapped", tmp_path)
    old_a = target["a"]
    with reference(), pytest.raises(json.JSONDecodeError):
        target.load_memmap_(prefix, allow_pickle=True)
    assert target["a"] is not old_a, "tensordict replaced the root leaves before failing"
    assert not target.is_locked and not target.is_memmap(), "and left the target unlocked"
    assert "zz_stale" in target.keys()  # noqa: SIM118 - a TensorDict iterates its batch dim


_ = pickle  # the pickle tests live in test_pickle_policy.py
