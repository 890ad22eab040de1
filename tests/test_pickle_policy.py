"""The pickle policy of ``tdckpt.load_memmap_`` / ``tdckpt.load_memmap`` (``allow_pickle``).

* ``True`` loads pickled non-tensor data, silently;
* ``False`` refuses before the target is touched, naming every pickled key and file, and never
  unpickles anything (``pickle.loads`` / ``pickle.load`` / ``pickle.Unpickler`` are booby-trapped);
* ``None`` (the default) loads with exactly one ``TdckptDeprecationWarning`` (a ``FutureWarning``)
  per call, which lists the keys, names tensordict 0.16 and both ways to opt in or out, and
  points at the caller's line; from tensordict 0.16 on (``tdckpt._restore.policy.policy_version``
  monkeypatched) it refuses like ``False``, with a message a user can act on;
* a checkpoint without pickles loads with every setting and no warning;
* a payload that would run code on unpickling (``os.mkdir`` of a marker) never runs under
  ``False`` or after the flip.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _expected import assert_matches_expected
from _restore_helpers import make_target, objects, reference, state
from _tdversion import writer_nulls
from conftest import copy_case, fixture_cases, tree_digest
from packaging.version import Version

tensordict = pytest.importorskip("tensordict")

import fixture_types  # noqa: E402
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict  # noqa: E402

import tdckpt  # noqa: E402
import tdckpt._restore.policy  # noqa: E402
from tdckpt.errors import PickleNotAllowedError, TdckptError  # noqa: E402
from tdckpt.warnings import TdckptDeprecationWarning  # noqa: E402

Point = fixture_types.Point

#: Every pickled entry of :func:`pickled_td`: (key, file relative to the prefix).
PICKLED = [
    ("n.pt", "n/pt/other.pickle"),
    ("ns", "ns/pickle.pkl"),
    ("tc.extra", "tc/_tensordict/extra/other.pickle"),
    ("ls.1.deep", "ls/1/deep/other.pickle"),
]

WARNING_MATCH = (
    r"loading pickled non-tensor data \(.*\) because allow_pickle was not given\. Pickle can "
    r"run arbitrary code\. Starting with tensordict 0\.16, the default becomes "
    r"allow_pickle=False and this load will be refused\. Pass allow_pickle=True to load trusted "
    r"data, or allow_pickle=False to refuse pickles now\."
)


def pickled_td() -> TensorDict:
    """Pickles at every kind of place: nested NonTensorData, a NonTensorStack of objects, a
    tensorclass field, a lazy-stack member; plus JSON-able non-tensor data that is not pickled."""
    td = TensorDict(
        a=torch.arange(2.0), n=TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2]
    )
    td.set_non_tensor("jsonval", "json, not a pickle")
    td["n"].set_non_tensor("pt", Point(1, 2))
    td["ns"] = NonTensorStack(NonTensorData(Point(1, 1)), NonTensorData(Point(2, 2)))
    td["tc"] = fixture_types.FixtureTC(
        obs=torch.ones(2, 1), reward=torch.ones(2), label="l", extra=Point(3, 3), batch_size=[2]
    )
    td["ls"] = LazyStackedTensorDict(
        TensorDict(q=torch.ones(1)), TensorDict(q=torch.ones(2)), stack_dim=0
    )
    td["ls"].tensordicts[1].set_non_tensor("deep", {1: "an int key"})
    return td


def plain_td() -> TensorDict:
    td = TensorDict(
        a=torch.arange(2.0), n=TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2]
    )
    td.set_non_tensor("plain", {"json": [1, 2.5, None, "x"]})
    return td


def write(prefix: Path, td: Any) -> Path:
    with reference():
        td.memmap(prefix)
    return prefix


def target_for(td: Any) -> Any:
    with reference():  # the content's own pickles, loaded by tensordict to shape the target
        return make_target(td)


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail the test if anything unpickles while it runs."""
    calls: list[str] = []

    def trap(name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"pickle.{name} was called")

        return refuse

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, trap(name))
    return calls


@pytest.fixture
def flipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend tensordict 0.16 is installed: the default allow_pickle=None now refuses."""
    monkeypatch.setattr(tdckpt._restore.policy, "policy_version", lambda: Version("0.16.0"))


def _line() -> int:
    """The line number of the caller."""
    return sys._getframe(1).f_lineno


def _assert_unchanged(
    target: Any, before: tuple[Any, Any], prefix: Path, digest: dict[str, str]
) -> None:
    objs, st = before
    now = objects(target)
    assert now.keys() == objs.keys()
    assert all(now[p] is o for p, o in objs.items())
    assert state(target, (prefix, "<ckpt>")) == st
    assert tree_digest(prefix) == digest


# ----------------------------------------------------------------------------------- True


def test_true_loads_silently(tmp_path: Path) -> None:
    prefix = write(tmp_path / "ckpt", pickled_td())
    target = target_for(pickled_td())
    tdckpt.load_memmap_(target, prefix, allow_pickle=True)  # filterwarnings=error: no warning
    assert target["n", "pt"] == Point(1, 2)
    assert target.get("ns").tolist() == [Point(1, 1), Point(2, 2)]  # 0.14: td["ns"] is a list
    assert target["tc"].extra == Point(3, 3)
    assert target["ls"].tensordicts[1]["deep"] == {1: "an int key"}
    new = tdckpt.load_memmap(prefix, allow_pickle=True)
    assert new["n", "pt"] == Point(1, 2) and new["tc"].extra == Point(3, 3)


def test_true_on_the_corpus(tmp_path: Path) -> None:
    fc = next(c for c in fixture_cases(versions=["0.15.3"]) if c.name == "non_tensor_pickle")
    td = tdckpt.load_memmap(copy_case(tmp_path, fc), allow_pickle=True)
    assert td["point"] == Point(1, 2) and td["set"] == {1, 2} and td["bytes"] == b"\x00\x01\xff"


# ---------------------------------------------------------------------------------- False


@pytest.mark.parametrize("kind", ["fresh", "memmapped"])
def test_false_refuses_before_touching_anything(
    kind: str, tmp_path: Path, no_unpickling: list[str]
) -> None:
    prefix = write(tmp_path / "ckpt", pickled_td())
    target = target_for(pickled_td())
    if kind == "memmapped":
        with reference():
            target.memmap_(tmp_path / "own")
    digest = tree_digest(prefix)
    before = objects(target), state(target, (prefix, "<ckpt>"))

    with pytest.raises(PickleNotAllowedError) as info:
        tdckpt.load_memmap_(target, prefix, allow_pickle=False)

    message = str(info.value)
    assert message.startswith(
        f"{prefix}: refusing to load pickled non-tensor data under allow_pickle=False: "
    )
    for key, file in PICKLED:
        assert f"{key} ({file})" in message
    assert "jsonval" not in message, "JSON non-tensor data is not a pickle"
    assert "Pass allow_pickle=True only if you trust this checkpoint" in message
    assert "tdckpt upgrade --convert-pickles" in message
    assert [".".join(k) for k in info.value.keys] == [k for k, _ in PICKLED]
    assert info.value.files == [f for _, f in PICKLED]
    assert isinstance(info.value, TdckptError)
    assert no_unpickling == []
    _assert_unchanged(target, before, prefix, digest)

    with pytest.raises(PickleNotAllowedError, match="refusing to load pickled"):
        tdckpt.load_memmap(prefix, allow_pickle=False)
    assert no_unpickling == []


def test_false_names_every_pickle_even_beyond_the_listing(
    tmp_path: Path, no_unpickling: list[str]
) -> None:
    td = TensorDict(batch_size=[])
    for i in range(13):
        td.set_non_tensor(f"p{i:02d}", Point(i, i))
    prefix = write(tmp_path / "ckpt", td)
    with pytest.raises(
        PickleNotAllowedError, match=r"p09 \(p09/other\.pickle\) and 3 more\."
    ) as info:
        tdckpt.load_memmap(prefix, allow_pickle=False)
    assert sorted(".".join(k) for k in info.value.keys) == [f"p{i:02d}" for i in range(13)]
    assert sorted(info.value.files) == [f"p{i:02d}/other.pickle" for i in range(13)]
    assert no_unpickling == []


def test_false_on_the_corpus(tmp_path: Path, no_unpickling: list[str]) -> None:
    fc = next(c for c in fixture_cases(versions=["0.15.3"]) if c.name == "non_tensor_pickle")
    prefix = copy_case(tmp_path, fc)
    with pytest.raises(PickleNotAllowedError) as info:
        tdckpt.load_memmap(prefix, allow_pickle=False)
    for key in ("bytes", "date", "point", "set"):
        assert f"{key} ({key}/other.pickle)" in str(info.value)
    assert no_unpickling == []


def test_a_key_named_other_pickle_is_not_a_pickle(tmp_path: Path, no_unpickling: list[str]) -> None:
    """odd_nested: the key 'other.pickle' names a sub-TensorDict (a directory), not a pickle."""
    fc = next(c for c in fixture_cases(versions=["0.15.3"]) if c.name == "odd_nested__default")
    td = tdckpt.load_memmap(copy_case(tmp_path, fc), allow_pickle=False)
    assert isinstance(td["other.pickle"], TensorDict)
    assert_matches_expected(td, fc.expected)
    assert no_unpickling == []


# ----------------------------------------------------------------------------------- None


def test_none_warns_once_per_call_at_the_callers_line(tmp_path: Path) -> None:
    prefix = write(tmp_path / "ckpt", pickled_td())
    target = target_for(pickled_td())
    for _ in range(2):  # once per call, every call
        with pytest.warns(TdckptDeprecationWarning, match=WARNING_MATCH) as rec:
            line = _line() + 1
            out = tdckpt.load_memmap_(target, prefix)
        assert out is target and target["n", "pt"] == Point(1, 2)
        assert len(rec) == 1, [str(w.message) for w in rec]
        w = rec[0]
        assert w.filename == __file__ and w.lineno == line
        assert issubclass(w.category, FutureWarning)
        assert w.message.removal == "0.16" and w.message.since
        text = str(w.message)
        assert text.startswith(f"{prefix}: ")
        for key, file in PICKLED:
            assert f"{key} ({file})" in text
        assert "jsonval" not in text

    with pytest.warns(TdckptDeprecationWarning, match=WARNING_MATCH) as rec:
        line = _line() + 1
        new = tdckpt.load_memmap(prefix)
    assert len(rec) == 1 and rec[0].filename == __file__ and rec[0].lineno == line
    assert new["tc"].extra == Point(3, 3)


def test_none_warning_points_at_a_wrapper_in_another_module(tmp_path: Path) -> None:
    """The stack level names the first frame outside tdckpt: the user's wrapper."""
    module_file = tmp_path / "user_code.py"
    module_file.write_text(
        "import tdckpt\n"
        "\n"
        "def restore(target, prefix):\n"
        "    return tdckpt.load_memmap_(target, prefix)\n"
    )
    spec = importlib.util.spec_from_file_location("user_code_for_tdckpt_test", module_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prefix = write(tmp_path / "ckpt", pickled_td())
    with pytest.warns(TdckptDeprecationWarning, match=WARNING_MATCH) as rec:
        module.restore(target_for(pickled_td()), prefix)
    assert len(rec) == 1
    assert rec[0].filename == str(module_file) and rec[0].lineno == 4


def test_none_after_the_flip_refuses(
    tmp_path: Path, flipped: None, no_unpickling: list[str]
) -> None:
    prefix = write(tmp_path / "ckpt", pickled_td())
    target = target_for(pickled_td())
    digest = tree_digest(prefix)
    before = objects(target), state(target, (prefix, "<ckpt>"))

    with pytest.raises(PickleNotAllowedError) as info:
        tdckpt.load_memmap_(target, prefix)

    listing = ", ".join(f"{key} ({file})" for key, file in PICKLED)
    assert str(info.value) == (
        f"{prefix}: this checkpoint holds pickled non-tensor data ({listing}), and since "
        "tensordict 0.16 the default allow_pickle=None refuses pickles. Pass allow_pickle=True "
        "if you trust this checkpoint (pickle can run arbitrary code), or run `tdckpt upgrade "
        "--convert-pickles` on a trusted copy."
    )
    assert no_unpickling == []
    _assert_unchanged(target, before, prefix, digest)
    with pytest.raises(
        PickleNotAllowedError, match="the default allow_pickle=None refuses pickles"
    ):
        tdckpt.load_memmap(prefix)


def test_after_the_flip_true_still_loads_and_false_still_refuses(
    tmp_path: Path, flipped: None
) -> None:
    prefix = write(tmp_path / "ckpt", pickled_td())
    assert tdckpt.load_memmap(prefix, allow_pickle=True)["n", "pt"] == Point(1, 2)
    with pytest.raises(PickleNotAllowedError, match="under allow_pickle=False"):
        tdckpt.load_memmap(prefix, allow_pickle=False)


@pytest.mark.parametrize(
    ("installed", "refuses"),
    [
        ("0.14.3", False),
        ("0.15.3", False),
        ("0.15.99", False),
        ("0.16.0", True),
        ("0.16.1", True),
        ("1.0", True),
    ],
)
def test_the_flip_is_one_version_comparison(
    installed: str, refuses: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Version("0.16") == tdckpt._restore.policy.PICKLE_DEFAULT_FLIP
    monkeypatch.setattr(tdckpt._restore.policy, "policy_version", lambda: Version(installed))
    prefix = write(tmp_path / "ckpt", pickled_td())
    if refuses:
        with pytest.raises(PickleNotAllowedError, match=r"since tensordict 0\.16"):
            tdckpt.load_memmap(prefix)
    else:
        with pytest.warns(TdckptDeprecationWarning, match=WARNING_MATCH) as rec:
            tdckpt.load_memmap(prefix)
        assert len(rec) == 1 and rec[0].filename == __file__


def test_policy_version_is_the_installed_tensordict() -> None:
    assert tdckpt._restore.policy.policy_version() == Version(tensordict.__version__)


# ---------------------------------------------------------------------------- no pickles


@pytest.mark.parametrize("allow_pickle", [True, False, None])
@pytest.mark.parametrize("flip", [False, True], ids=["before-flip", "after-flip"])
def test_no_pickles_loads_with_every_setting(
    allow_pickle: bool | None,
    flip: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_unpickling: list[str],
) -> None:
    if flip:
        monkeypatch.setattr(tdckpt._restore.policy, "policy_version", lambda: Version("0.16.0"))
    prefix = write(tmp_path / "ckpt", plain_td())
    target = make_target(plain_td())
    with writer_nulls(calls=2):  # and no other warning (none at all from 0.15.2 on)
        tdckpt.load_memmap_(target, prefix, allow_pickle=allow_pickle)
        loaded = tdckpt.load_memmap(prefix, allow_pickle=allow_pickle)
    assert target["plain"] == {"json": [1, 2.5, None, "x"]}
    assert loaded["a"].tolist() == [0.0, 1.0]
    assert no_unpickling == []


def test_no_pickles_in_the_corpus(tmp_path: Path, no_unpickling: list[str]) -> None:
    for fc in fixture_cases(versions=["0.15.3"]):
        if fc.name in ("non_tensor_pickle", "non_tensor_lossy", "odd_nested__robust_false"):
            continue
        tdckpt.load_memmap(copy_case(tmp_path, fc), allow_pickle=False)
    assert no_unpickling == []


# ------------------------------------------------------------------------ hostile payloads


class _Payload:
    """Unpickling this creates the marker directory (stands for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.marker),))


def _hostile_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "PWNED"
    td = TensorDict(
        a=torch.arange(2.0), n=TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2]
    )
    td["n"].set_non_tensor("evil", Point(0, 0))  # pickled: other.pickle, replaced below
    prefix = write(tmp_path / "ckpt", td)
    (prefix / "n" / "evil" / "other.pickle").write_bytes(pickle.dumps({"data": _Payload(marker)}))
    return prefix, marker


def test_hostile_pickle_never_runs_under_false(tmp_path: Path) -> None:
    prefix, marker = _hostile_checkpoint(tmp_path)
    target = TensorDict(a=torch.zeros(2), batch_size=[2])
    with pytest.raises(PickleNotAllowedError, match=r"n\.evil \(n/evil/other\.pickle\)"):
        tdckpt.load_memmap_(target, prefix, allow_pickle=False)
    with pytest.raises(PickleNotAllowedError):
        tdckpt.load_memmap(prefix, allow_pickle=False)
    assert not marker.exists()


def test_hostile_pickle_never_runs_after_the_flip(tmp_path: Path, flipped: None) -> None:
    prefix, marker = _hostile_checkpoint(tmp_path)
    with pytest.raises(PickleNotAllowedError, match="refuses pickles"):
        tdckpt.load_memmap_(TensorDict(a=torch.zeros(2), batch_size=[2]), prefix)
    with pytest.raises(PickleNotAllowedError):
        tdckpt.load_memmap(prefix)
    assert not marker.exists()


def test_hostile_pickle_is_real(tmp_path: Path) -> None:
    """Control: the payload does run when the user says the data is trusted."""
    prefix, marker = _hostile_checkpoint(tmp_path)
    tdckpt.load_memmap(prefix, allow_pickle=True)
    assert marker.is_dir()
