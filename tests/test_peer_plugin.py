"""The peer-suite tools of tests/peer/: the routing plugin and the runner script.

``tdckpt_peer`` must really route ``TensorDictBase.load_memmap_`` and the classmethod
``TensorDictBase.load_memmap`` (and what calls them) through tdckpt, and put tensordict's
methods back; ``run_peer.py`` must refuse a path that is not
tensordict's test folder (or lies inside this repository), and report a test that fails only
when routed. The end-to-end run uses a tiny stand-in for tensordict's test folder.
"""

from __future__ import annotations

import contextlib
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _tdversion import TD_VERSION
from packaging.version import Version

import tdckpt
from tdckpt.errors import CheckpointNotFoundError

pytest.importorskip("tensordict")
from tensordict import TensorDict, TensorDictBase

PEER = Path(__file__).resolve().parent / "peer"
sys.path.insert(0, str(PEER))
import run_peer  # noqa: E402
import tdckpt_peer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture
def routed() -> object:
    original = TensorDictBase.load_memmap_
    tdckpt_peer.install()
    try:
        yield original
    finally:
        tdckpt_peer.uninstall()
    assert TensorDictBase.load_memmap_ is original


def test_the_plugin_routes_load_memmap_and_what_calls_it(
    tmp_path: Path, routed: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert TensorDictBase.load_memmap_ is not routed
    assert TensorDictBase.load_memmap_.__tdckpt_routed__  # type: ignore[attr-defined]
    TensorDict(a=torch.ones(3), batch_size=[3]).memmap(tmp_path / "ck")
    calls = []
    real = tdckpt.load_memmap_

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tdckpt, "load_memmap_", spy)
    td = TensorDict(a=torch.zeros(3), old=torch.zeros(3), batch_size=[3])
    assert td.load_memmap_(tmp_path / "ck", mode="r") is td
    assert sorted(td.keys()) == ["a"] and td["a"].tolist() == [1.0, 1.0, 1.0]
    assert calls == [{"allow_pickle": None, "mode": "r"}]
    # the alias calls load_memmap_; tensordict 0.15 deprecates it, 0.14 does not warn
    deprecated = TD_VERSION is not None and Version("0.15") <= TD_VERSION
    with pytest.warns(DeprecationWarning) if deprecated else contextlib.nullcontext():
        td.load_(tmp_path / "ck")
    assert len(calls) == 2
    mm = TensorDict(a=torch.zeros(3), batch_size=[3]).memmap(tmp_path / "mm")
    TensorDict(a=torch.full((3,), 2.0), batch_size=[3]).memmap(tmp_path / "mm", existsok=True)
    mm.memmap_refresh_()
    assert len(calls) == 3 and mm["a"].tolist() == [2.0, 2.0, 2.0]
    # tdckpt's errors, not tensordict's, come out of a routed call
    with pytest.raises(CheckpointNotFoundError):
        td.load_memmap_(tmp_path / "missing")


def test_the_plugin_routes_the_classmethod_and_what_calls_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorDict.load_memmap (the classmethod), hence TensorDict.load and the loaders of
    tensorclasses defined while the plugin is installed; out= goes to load_memmap_; a
    subpath= load stays tensordict's; uninstall puts back the inherited classmethod."""
    from tensordict import tensorclass

    inherited = TensorDictBase.load_memmap
    # tensordict 0.15 defines it on a base class (_Serialization), 0.14 on TensorDictBase
    own = "load_memmap" in TensorDictBase.__dict__
    TensorDict(a=torch.ones(3), n=TensorDict(b=torch.zeros(3)), batch_size=[3]).memmap(
        tmp_path / "ck"
    )
    calls: list[str] = []
    real_new, real_into = tdckpt.load_memmap, tdckpt.load_memmap_

    def new(*args: object, **kwargs: object) -> object:
        calls.append("new")
        return real_new(*args, **kwargs)  # type: ignore[arg-type]

    def into(*args: object, **kwargs: object) -> object:
        calls.append("into")
        return real_into(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tdckpt, "load_memmap", new)
    monkeypatch.setattr(tdckpt, "load_memmap_", into)
    tdckpt_peer.install(("load_memmap",))
    try:
        assert TensorDict.load_memmap.__func__.__tdckpt_routed__  # type: ignore[attr-defined]
        loaded = TensorDict.load_memmap(tmp_path / "ck", mode="r")
        assert loaded["a"].tolist() == [1.0, 1.0, 1.0] and calls == ["new"]
        assert TensorDict.load(tmp_path / "ck")["n", "b"].tolist() == [0.0, 0.0, 0.0]
        assert calls == ["new", "new"]
        out = TensorDict(a=torch.zeros(3), n=TensorDict(b=torch.ones(3)), batch_size=[3])
        assert TensorDict.load_memmap(tmp_path / "ck", out=out) is out
        assert calls[-1] == "into" and out["a"].tolist() == [1.0, 1.0, 1.0]

        @tensorclass
        class Pair:
            x: torch.Tensor

        Pair(x=torch.arange(3), batch_size=[3]).memmap(tmp_path / "tc")
        calls.clear()
        assert Pair.load_memmap(tmp_path / "tc").x.tolist() == [0, 1, 2]
        assert calls == ["new"]
        calls.clear()
        sub = TensorDict.load_memmap(tmp_path / "ck", subpath="n")
        assert sub["b"].tolist() == [0.0, 0.0, 0.0]  # tensordict's own subpath= read
        with pytest.raises(CheckpointNotFoundError):
            TensorDict.load(tmp_path / "missing")
    finally:
        tdckpt_peer.uninstall()
    assert ("load_memmap" in TensorDictBase.__dict__) == own
    assert TensorDictBase.load_memmap == inherited


def test_the_route_is_chosen_by_the_environment() -> None:
    assert tdckpt_peer.routed_entry_points({}) == ("load_memmap_", "load_memmap")
    assert tdckpt_peer.routed_entry_points({"TDCKPT_PEER_ROUTE": " load_memmap_ "}) == (
        "load_memmap_",
    )
    assert tdckpt_peer.routed_entry_points({"TDCKPT_PEER_ROUTE": "load_memmap"}) == ("load_memmap",)
    with pytest.raises(pytest.UsageError, match=r"cannot route; known entry points"):
        tdckpt_peer.routed_entry_points({"TDCKPT_PEER_ROUTE": "load_memmap_,save"})


# -- the runner --------------------------------------------------------------------------------


def test_the_runner_refuses_a_bad_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_peer.main([str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert run_peer.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "not tensordict's test/ folder" in err and "tensordict/test_methods.py" in err
    inside = Path(__file__).resolve().parent
    assert run_peer.main([str(inside)]) == 2
    assert "inside this repository" in capsys.readouterr().err
    fake = _fake_suite(tmp_path)
    assert run_peer.main([str(fake), "--runs", "routed"]) == 2
    assert "a single run needs --out" in capsys.readouterr().err


def test_the_comparison_names_new_and_documented_failures() -> None:
    plain = {"test/a.py::t_both": "boom", "test/a.py::t_plain": "boom"}
    routed = {"test/a.py::t_both": "boom", "test/a.py::t_new": "E", "test/a.py::t_doc": "E"}
    lines, new = run_peer.compare(plain, routed, {"test/a.py::t_doc": "no checkpoint rewrite"})
    assert new == ["test/a.py::t_new"]
    assert "  documented: test/a.py::t_doc - no checkpoint rewrite" in lines
    assert "  NEW: test/a.py::t_new - E" in lines
    assert lines[-1] == "  test/a.py::t_plain"


def _fake_suite(tmp_path: Path) -> Path:
    """A stand-in for tensordict's test/ folder: one test fails only when routed."""
    test = tmp_path / "td" / "test"
    for rel in ("conftest.py", *run_peer.FILES):
        (test / rel).parent.mkdir(parents=True, exist_ok=True)
        (test / rel).write_text("")
    (test / run_peer.FILES[0]).write_text(
        textwrap.dedent(
            """
            import torch
            from tensordict import TensorDict, TensorDictBase

            def test_load_memmap_roundtrip(tmp_path):
                TensorDict(a=torch.ones(2), batch_size=[2]).memmap(tmp_path / "ck")
                td = TensorDict(a=torch.zeros(2), batch_size=[2])
                assert td.load_memmap_(tmp_path / "ck") is td and td["a"].sum() == 2

            def test_load_memmap_is_tensordicts_own():
                assert not getattr(TensorDictBase.load_memmap_, "__tdckpt_routed__", False)

            def test_memmap_fails_in_both():
                raise AssertionError("broken in both runs")
            """
        )
    )
    return test


def test_the_runner_reports_a_failure_only_the_routed_run_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _fake_suite(tmp_path)
    out = tmp_path / "out"
    status = run_peer.main([str(fake), "--out", str(out), "--timeout", "300"])
    text = capsys.readouterr().out
    assert status == 1, text
    assert "plain failures: 1; routed failures: 2" in text
    assert "NEW: test/tensordict/test_methods.py::test_load_memmap_is_tensordicts_own" in text
    rows = [json.loads(line) for line in (out / "routed.jsonl").read_text().splitlines()]
    assert {r["node"].rpartition("::")[2]: r["outcome"] for r in rows} == {
        "test_load_memmap_roundtrip": "passed",
        "test_load_memmap_is_tensordicts_own": "failed",
        "test_memmap_fails_in_both": "failed",
    }
    # comparing the files already there, without running again
    assert run_peer.main([str(fake), "--out", str(out), "--runs", ""]) == 1


class _Marker:
    ran = False

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_Marker._load, ())

    @staticmethod
    def _load() -> str:
        _Marker.ran = True
        return "loaded"


def test_a_refused_pickle_is_the_runtime_error_tensordict_raises(
    tmp_path: Path, routed: object
) -> None:
    """The one difference the first routed peer run found
    (test_nontensor.py::TestNonTensorData::test_memmap_pickle_rejected_before_execution):
    tensordict refuses a pickle with a RuntimeError, and tdckpt's PickleNotAllowedError is one."""
    from tensordict import NonTensorData

    td = TensorDict(tensor=torch.zeros(1), value=NonTensorData(data=_Marker(), batch_size=[]))
    td.memmap_(tmp_path)
    _Marker.ran = False
    with pytest.raises(RuntimeError, match="allow_pickle=True") as info:
        td.memmap_refresh_(allow_pickle=False)
    assert isinstance(info.value, tdckpt.errors.PickleNotAllowedError)
    assert not _Marker.ran
