"""``tdckpt.diff`` and ``tdckpt diff``: what differs between two checkpoints, key by key."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import copy_case, tree_digest
from tensordict import NonTensorData, TensorDict

import tdckpt
from tdckpt import cli
from tdckpt._read.directory import DirectoryStorage
from tdckpt.errors import ValidationError

FIXTURES = Path("/work/shared/fixtures")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _target(version: str, case: str) -> Path:
    with open(FIXTURES / version / "manifest.json", encoding="utf-8") as f:
        target = json.load(f)["cases"][case].get("target", "ckpt")
    return FIXTURES / version / case / target


def _changes(report: tdckpt.DiffReport) -> dict[tuple[str, ...], tuple[str, tuple[str, ...]]]:
    return {e.key: (e.change, e.fields) for e in report.entries}


@pytest.mark.parametrize("version", ["0.2.1", "0.3.2", "0.8.3", "0.12.4", "0.14.3"])
@pytest.mark.parametrize("case", ["nested", "lazy_stack", "non_tensor_json"])
def test_releases_that_wrote_the_same_data_compare_equal(version: str, case: str) -> None:
    # Every generation goes through the read path (migrated in memory), so the same data
    # written by tensordict 0.2 and 0.15 compares equal, whatever the layout on disk.
    a, b = _target(version, case), _target("0.15.3", case)
    if not a.exists():
        pytest.skip(f"tensordict {version} did not write {case}")
    before = tree_digest(a), tree_digest(b)
    report = tdckpt.diff(a, b)
    assert report.equal, [str(e) for e in report.entries]
    assert report.unchanged > 0 and report.changed_bytes == 0
    assert (tree_digest(a), tree_digest(b)) == before  # nothing written


def test_a_key_lost_by_an_old_writer_shows_as_added() -> None:
    # tensordict 0.2.1 could not write bfloat16: its flat fixture has no bf16 leaf.
    report = tdckpt.diff(_target("0.2.1", "flat"), _target("0.15.3", "flat"))
    assert _changes(report) == {("bf16",): ("added", ())}
    assert report.changed_bytes == 3 * 2
    assert str(report.entries[0]) == "+ bf16: bfloat16 [3] (6 B)"


def test_directory_and_archive_of_the_same_data_are_equal(tmp_path: Path) -> None:
    td = TensorDict(
        a=torch.arange(6.0).reshape(3, 2), n=TensorDict(b=torch.ones(3)), batch_size=[3]
    )
    td.memmap(tmp_path / "dir")
    tdckpt.save(td, tmp_path / "arch.tdz")
    assert tdckpt.diff(tmp_path / "dir", tmp_path / "arch.tdz").equal


def test_every_kind_of_change(tmp_path: Path) -> None:
    # (Keys are not named "shape" or "dtype": tensordict's meta.json cannot hold those.)
    a = TensorDict(
        same=torch.arange(4),
        bytes_=torch.zeros(4),
        dt=torch.zeros(4),
        sh=torch.zeros(4),
        gone=torch.zeros(4),
        kind=torch.zeros(4),
        nested=TensorDict(x=torch.ones(4), batch_size=[4]),
        text=NonTensorData("old", batch_size=[4]),
        batch_size=[4],
    )
    b = TensorDict(
        same=torch.arange(4),
        bytes_=torch.tensor([0.0, 0.0, -0.0, 1.0]),
        dt=torch.zeros(4, dtype=torch.float64),
        sh=torch.zeros(4, 1),
        new=torch.ones(4, 2),
        kind=TensorDict(y=torch.zeros(4), batch_size=[4]),
        nested=TensorDict(x=torch.ones(4), batch_size=[4]),
        text=NonTensorData("new", batch_size=[4]),
        batch_size=[4],
    )
    a.memmap(tmp_path / "a")
    b.memmap(tmp_path / "b")
    report = tdckpt.diff(tmp_path / "a", tmp_path / "b")
    assert _changes(report) == {
        ("bytes_",): ("changed", ("bytes",)),
        ("dt",): ("changed", ("dtype",)),
        ("sh",): ("changed", ("shape",)),
        ("gone",): ("removed", ()),
        ("new",): ("added", ()),
        ("kind",): ("changed", ("kind",)),
        ("kind", "y"): ("added", ()),
        ("text",): ("changed", ("value",)),
    }
    assert not report.equal and report.unchanged == 4  # root, same, nested, nested.x
    # What an incremental save of b would write: the new and changed leaves' bytes.
    assert report.changed_bytes == 16 + 32 + 16 + 32 + 16
    text = [str(e) for e in report.entries]
    assert "~ text: value: non-tensor 'old' -> non-tensor 'new'" in text
    assert "~ dt: dtype: float32 [4] (16 B) -> float64 [4] (32 B)" in text
    assert report.to_json()["equal"] is False


def test_bytes_are_compared_not_values(tmp_path: Path) -> None:
    # NaN equals itself (same bytes); 0.0 and -0.0 differ (different bytes), every dtype.
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64):
        nan = torch.full((5,), float("nan"), dtype=dtype)
        TensorDict(x=nan).memmap(tmp_path / f"{dtype}-a")
        TensorDict(x=nan.clone()).memmap(tmp_path / f"{dtype}-b")
        assert tdckpt.diff(tmp_path / f"{dtype}-a", tmp_path / f"{dtype}-b").equal, dtype
        TensorDict(x=torch.zeros(5, dtype=dtype)).memmap(tmp_path / f"{dtype}-c")
        TensorDict(x=-torch.zeros(5, dtype=dtype)).memmap(tmp_path / f"{dtype}-d")
        report = tdckpt.diff(tmp_path / f"{dtype}-c", tmp_path / f"{dtype}-d")
        assert _changes(report) == {("x",): ("changed", ("bytes",))}, dtype


def test_pickled_values_compare_by_bytes_never_unpickled(tmp_path: Path) -> None:
    # a set is stored as a pickle (tdckpt.save writes it as tensordict 0.15.3 does; 0.14's
    # memmap cannot)
    a = TensorDict(v=NonTensorData({1, 2}, batch_size=[]))
    tdckpt.save(a, tmp_path / "a")
    tdckpt.save(a, tmp_path / "b")
    tdckpt.save(TensorDict(v=NonTensorData({1, 3}, batch_size=[])), tmp_path / "c")
    pickles = sorted(p for p in (tmp_path / "a").rglob("*.pickle"))
    assert pickles, "the fixture must hold a pickle"
    assert tdckpt.diff(tmp_path / "a", tmp_path / "b").equal
    assert _changes(tdckpt.diff(tmp_path / "a", tmp_path / "c")) == {
        ("v",): ("changed", ("value",))
    }
    # A pickle that would run code when loaded: compared as bytes, never loaded.
    hostile = pickle.dumps(_Boom())
    (tmp_path / "b" / pickles[0].relative_to(tmp_path / "a")).write_bytes(hostile)
    assert _changes(tdckpt.diff(tmp_path / "a", tmp_path / "b")) == {
        ("v",): ("changed", ("value",))
    }


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (pytest.fail, ("diff unpickled a value",))


def test_manifest_checksums_decide_without_reading_the_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tdckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, TensorDict(w=torch.zeros(1000), b=torch.ones(10)))
        mgr.save(2, TensorDict(w=torch.zeros(1000), b=torch.ones(10) * 2))
        a, b = mgr.path(1), mgr.path(2)
    mapped: list[str] = []
    real = DirectoryStorage.map

    def spy(self: DirectoryStorage, rel: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        mapped.append(rel)
        return real(self, rel, *args, **kwargs)

    monkeypatch.setattr(DirectoryStorage, "map", spy)
    assert _changes(tdckpt.diff(a, b)) == {("b",): ("changed", ("bytes",))}
    assert mapped == []  # both steps record checksums: no leaf byte was read
    # Without a manifest on one side the bytes are read.
    TensorDict(w=torch.zeros(1000), b=torch.ones(10)).memmap(tmp_path / "plain")
    assert _changes(tdckpt.diff(tmp_path / "plain", b)) == {("b",): ("changed", ("bytes",))}
    assert sorted(mapped) == ["b.memmap", "b.memmap", "w.memmap", "w.memmap"]


def test_a_damaged_side_is_refused_naming_it(tmp_path: Path) -> None:
    good = copy_case(tmp_path, "0.15.3", "flat")
    bad = tmp_path / "bad"
    TensorDict(a=torch.zeros(100)).memmap(bad)
    (bad / "a.memmap").write_bytes(b"\0" * 10)  # truncated
    with pytest.raises(ValidationError, match=r"bad: cannot be compared: 1 error\(s\).*a\.memmap"):
        tdckpt.diff(good, bad)


# -- the command ---------------------------------------------------------------------------


def test_cli_exit_codes_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    TensorDict(a=torch.zeros(3), b=torch.ones(2)).memmap(tmp_path / "a")
    TensorDict(a=torch.zeros(3), b=torch.ones(2)).memmap(tmp_path / "same")
    TensorDict(a=torch.zeros(3), c=torch.ones(2)).memmap(tmp_path / "other")
    code, out, err = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "same"))
    assert (code, err) == (0, "") and "0 added, 0 removed, 0 changed, 3 unchanged" in out
    code, out, err = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "other"))
    assert code == 1 and err == ""
    assert out.splitlines()[:2] == ["- b: float32 [2] (8 B)", "+ c: float32 [2] (8 B)"]
    code, out, _ = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "other"), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["equal"] is False
    assert [(e["key"], e["change"]) for e in doc["entries"]] == [
        (["b"], "removed"),
        (["c"], "added"),
    ]
    # Trouble (a side that is not a checkpoint) is 2, as diff(1) says, not "different".
    code, out, err = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "absent"))
    assert code == 2 and out == "" and "absent" in err and err.startswith("error: ")
    code, out, _ = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "absent"), "--json")
    assert code == 2 and json.loads(out)["error"]["exit_code"] == 2


def test_cli_steps_of_a_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with tdckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(10, TensorDict(w=torch.zeros(4)))
        mgr.save(20, TensorDict(w=torch.ones(4)))
    code, out, _ = run(capsys, "diff", "10", "20", "--root", str(tmp_path / "run"))
    assert (
        code == 1 and out.splitlines()[0] == "~ w: bytes: float32 [4] (16 B) -> float32 [4] (16 B)"
    )
    code, _, _ = run(capsys, "diff", "10", "10", "--root", str(tmp_path / "run"))
    assert code == 0
    with pytest.raises(SystemExit) as exc:  # a usage error, as argparse's own
        run(capsys, "diff", "10", "x", "--root", str(tmp_path / "run"))
    assert exc.value.code == 2
    assert "with --root, A and B are steps: invalid step 'x'" in capsys.readouterr().err
    code, _, err = run(capsys, "diff", "10", "30", "--root", str(tmp_path / "run"))
    assert code == 2 and "30" in err
