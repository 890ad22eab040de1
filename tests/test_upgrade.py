"""On-disk upgrade: every fixture restores with plain tensordict 0.15.3 afterwards.

Also: dry run == real run, idempotence, hard links, pickle conversion, refusals before any
write, backups, archives, and a SIGKILL fault-injection run (``TDCKPT_FAULT_TRIALS``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path, PosixPath
from typing import Any

import pytest
import torch
from _expected import diff_expected
from _tdversion import PICKLE_WARNING_FLIP, READS_JSON_TYPES
from conftest import (
    FixtureCase,
    case_id,
    copy_case,
    fixture_cases,
    subprocess_env,
    tree_digest,
    writer_losses,
)

tensordict = pytest.importorskip("tensordict")
import fixture_types  # noqa: E402, F401  (the corpus's classes; tests/ is on sys.path)
from tensordict import TensorDict  # noqa: E402

import tdckpt  # noqa: E402
import tdckpt._upgrade.journal as journal_mod  # noqa: E402
import tdckpt._upgrade.upgrade as upgrade_mod  # noqa: E402
from tdckpt import schema  # noqa: E402  # noqa: E402
from tdckpt._upgrade.journal import BACKUP_MARK, JOURNAL_SUFFIX, STAGING_MARK  # noqa: E402
from tdckpt._upgrade.upgrade import upgrade  # noqa: E402
from tdckpt.errors import (  # noqa: E402
    IncompleteCheckpointError,
    LockError,
    UnsafePathError,
    UnsupportedFormatError,
    ValidationError,
)

TESTS = Path(__file__).resolve().parent
#: Cases no current layout can hold: a child collection named "meta.json" (tensordict <= 0.2).
REFUSED = {"0.2.1-odd_nested__default": "'meta.json'"}


def load(prefix: Path, **kwargs: Any) -> Any:
    """Plain tensordict 0.15.3; no warning is expected (pickles are acknowledged)."""
    kwargs.setdefault("allow_pickle", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return TensorDict.load_memmap(prefix, **kwargs)


def expected_after_upgrade(fc: FixtureCase) -> tuple[dict[str, Any], list[Any]]:
    """The manifest's ``expected``, minus what the *writer* destroyed (documented losses)."""
    return writer_losses(fc)


def leftovers(prefix: Path) -> list[str]:
    return sorted(
        p.name
        for p in prefix.parent.iterdir()
        if STAGING_MARK in p.name or p.name.endswith(JOURNAL_SUFFIX) or p.name.endswith(".tmp")
    )


def backups(prefix: Path) -> list[Path]:
    return sorted(
        p for p in prefix.parent.iterdir() if p.name.startswith(prefix.name + BACKUP_MARK)
    )


# -- every fixture ---------------------------------------------------------------------------


@pytest.mark.parametrize("fc", fixture_cases(), ids=case_id)
def test_upgrade_every_fixture(fc: FixtureCase, tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, fc)
    original = tree_digest(prefix)
    if fc.id in REFUSED:
        before = tree_digest(prefix.parent)
        with pytest.raises(ValidationError, match=REFUSED[fc.id]):
            upgrade(prefix)
        assert tree_digest(prefix.parent) == before, "a refused upgrade must not write"
        return
    report = upgrade(prefix)
    assert report.to_generation == "G8" and not report.dry_run
    assert leftovers(prefix) == []
    if not report.operations:  # already current
        assert report.from_generation == "G8" and report.steps == []
        assert tree_digest(prefix) == original and backups(prefix) == []
    else:
        (backup,) = backups(prefix)
        assert report.backup == str(backup)
        assert tree_digest(backup) == original, "the backup is the old tree, untouched"
        _check_manifest(prefix, report)
        if prefix.is_dir():
            _check_independent_of_backup(prefix, backup)
            _check_meta_formatting(prefix)
    if fc.name == "float8_dtypes":  # tensordict 0.15.3 writes float8 but cannot read it back
        with pytest.raises(KeyError, match="float8"):
            load(prefix)
        return
    exp, lost = expected_after_upgrade(fc)
    assert diff_expected(load(prefix), exp, lost=lost) == []
    again = upgrade(prefix)
    assert again.operations == [] and again.steps == [], "a second upgrade is a no-op"
    assert len(backups(prefix)) == (1 if report.operations else 0)


def _check_manifest(prefix: Path, report: upgrade_mod.UpgradeReport) -> None:
    raw = json.loads(_read_member(prefix, schema.MANIFEST_NAME))
    manifest = schema.Manifest.model_validate(raw)
    assert manifest.key_encoding == "robust"
    assert manifest.migrated_from == report.from_generation
    assert manifest.migrations == report.steps
    for record in manifest.files:
        assert record.checksum is not None, f"{record.path}: every file is checksummed"
        if record.path.endswith(".memmap"):
            assert record.checksum.startswith("crc32:"), "leaves: verify's default algorithm"
        elif record.path.endswith("meta.json"):
            assert record.checksum.startswith("sha256:")


def _read_member(prefix: Path, name: str) -> bytes:
    if prefix.is_dir():
        return (prefix / name).read_bytes()
    with zipfile.ZipFile(prefix) as zf:
        return zf.read(name)


def _check_independent_of_backup(prefix: Path, backup: Path) -> None:
    old = {p.stat().st_ino for p in backup.rglob("*") if p.is_file()}
    for leaf in prefix.rglob("*.memmap"):
        st = leaf.stat()
        assert st.st_ino not in old and st.st_nlink == 1, f"{leaf} shares a file with the backup"


def _check_meta_formatting(prefix: Path) -> None:
    for path in prefix.rglob("meta.json"):
        raw = path.read_bytes()
        meta = json.loads(raw)
        compact = "NonTensorStack" in str(meta.get("_type"))
        want = json.dumps(meta, separators=(",", ":")) if compact else json.dumps(meta)
        assert raw == want.encode(), f"{path} is not formatted as tensordict 0.15.3 writes it"


SAME_AS_0153 = [
    pytest.param(v, c, id=f"{v}-{c}")
    for v in ("0.3.2", "0.4.0", "0.8.3", "0.12.4", "0.13.0", "0.14.3")
    for c in (
        "flat",
        "nested",
        "lazy_stack",
        "zero_numel",
        "empty_td",
        "tensorclass",
        "tensorclass_in_td",
        "non_tensor_json",
        "nested_tensor_strided",
    )
    if (TESTS / "fixtures" / "tensordict" / v / c / "ckpt").is_dir()
    # 0.3 did not list children, so their order in the parent is not on disk
    and not (v == "0.3.2" and c in ("non_tensor_json", "tensorclass_in_td"))
]


@pytest.mark.parametrize(("version", "name"), SAME_AS_0153)
def test_upgraded_tree_is_what_0153_writes(version: str, name: str, tmp_path: Path) -> None:
    """Same content, same bytes: the upgrade writes exactly tensordict 0.15.3's layout."""
    prefix = copy_case(tmp_path, version, name)
    upgrade(prefix)
    mine = {k: v for k, v in tree_digest(prefix).items() if k != schema.MANIFEST_NAME}
    assert mine == tree_digest(_case("0.15.3", name).target)


# -- dry run, progress, backups ----------------------------------------------------------------

DRY_RUN_CASES = [
    ("0.2.1", "nested"),
    ("0.3.2", "non_tensor_pickle"),
    ("0.13.0", "odd_keys__default"),
    ("0.14.3", "archive_deflate"),
    ("0.15.3", "odd_keys__robust_false"),
]


@pytest.mark.parametrize(("version", "name"), DRY_RUN_CASES)
def test_dry_run_writes_nothing_and_lists_the_real_operations(
    version: str, name: str, tmp_path: Path
) -> None:
    prefix = copy_case(tmp_path, version, name)
    before = tree_digest(prefix.parent)
    dry = upgrade(prefix, dry_run=True)
    assert dry.dry_run and dry.operations and dry.backup is None
    assert tree_digest(prefix.parent) == before, "a dry run must not write"
    seen: list[tuple[int, int, str]] = []
    real = upgrade(prefix, progress=lambda done, total, what: seen.append((done, total, what)))
    assert real.operations == dry.operations
    assert [d for d, _t, _w in seen] == list(range(1, len(real.operations) + 1))
    assert {t for _d, t, _w in seen} == {len(real.operations)}
    kinds = [op.kind for op in real.operations]
    assert kinds[-2:] == ["backup", "swap"]
    assert "write-meta" in kinds
    assert ("copy" in kinds) == (not prefix.name.endswith(".tdz"))  # a backup is kept
    assert "link" not in kinds
    assert str(real) and "backup:" in str(real) and "backup" in json.dumps(real.to_json())


def test_backup_false_removes_the_old_tree(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.4.0", "nested")
    report = upgrade(prefix, backup=False)
    assert report.operations[-1].kind == "remove" and report.backup is None
    assert backups(prefix) == [] and leftovers(prefix) == []
    assert diff_expected(load(prefix), copy.deepcopy(dict(_case("0.4.0", "nested").expected))) == []


def test_existing_backup_is_never_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")

    class Frozen(journal_mod.datetime):  # type: ignore[name-defined,misc]
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return journal_mod.datetime(2030, 1, 2, 3, 4, 5, tzinfo=tz)

    monkeypatch.setattr(journal_mod, "datetime", Frozen)
    taken = prefix.parent / f"{prefix.name}{BACKUP_MARK}20300102T030405Z"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    report = upgrade(prefix)
    assert report.backup == f"{taken}-1"
    assert (taken / "keep.txt").read_text() == "mine"


def test_no_op_on_current_checkpoint_writes_nothing(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.15.3", "nested")
    before = tree_digest(prefix.parent)
    report = upgrade(prefix)
    assert report.operations == [] and "already current" in str(report)
    assert tree_digest(prefix.parent) == before


# -- refusals ----------------------------------------------------------------------------------


def test_refuses_a_damaged_checkpoint_before_writing(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.3.2", "nested")
    (prefix / "lvl1" / "x.memmap").write_bytes(b"\0" * 5)  # 24 bytes needed
    before = tree_digest(prefix.parent)
    with pytest.raises(
        ValidationError, match=r"cannot upgrade, nothing was written.*short-file|5 bytes"
    ):
        upgrade(prefix)
    assert tree_digest(prefix.parent) == before


def test_newer_format_is_refused(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.15.3", "flat")
    meta = json.loads((prefix / "meta.json").read_text())
    meta["_format_version"] = 2
    (prefix / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        UnsupportedFormatError, match=r"newer tensordict format \(2\).*upgrade tdckpt"
    ):
        upgrade(prefix)


def test_symlinked_prefix_is_refused(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    link = tmp_path / "link"
    link.symlink_to(prefix)
    with pytest.raises(UnsafePathError, match="is a symlink"):
        upgrade(link)


def test_keys_outside_the_prefix_reach_the_user(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.12.4", "odd_nested__default")
    report = upgrade(prefix)
    lost = "\n".join(report.lost)
    assert "'..'" in lost and "'.'" in lost and "outside this directory" in lost
    assert "'..'" in str(report)


def test_dry_run_with_an_interrupted_upgrade_is_refused(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    # torn before any step: only the temporary journal exists (the journal itself is
    # linked or renamed into place complete, never torn)
    (prefix.parent / f".{prefix.name}{JOURNAL_SUFFIX}.tmp").write_text("")
    with pytest.raises(IncompleteCheckpointError, match="interrupted"):
        upgrade(prefix, dry_run=True)
    report = upgrade(prefix)  # a real run clears the never-started journal first
    assert report.recovered and leftovers(prefix) == []


def test_one_upgrade_at_a_time(tmp_path: Path) -> None:
    import fcntl

    prefix = copy_case(tmp_path, "0.8.3", "flat")
    fd = os.open(prefix.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running upgrade holds it
        with pytest.raises(LockError, match="another tdckpt upgrade is running"):
            upgrade(prefix)
        assert upgrade(prefix, dry_run=True).operations  # a dry run only reads
    finally:
        os.close(fd)
    assert upgrade(prefix).operations


# -- pickles -----------------------------------------------------------------------------------


def _pickled_checkpoint(tmp_path: Path) -> Path:
    """A 0.14-era checkpoint whose pickles hold JSON data, plus one real object."""
    prefix = copy_case(tmp_path, "0.14.3", "non_tensor_json")
    # "s": the accidental _metadata pickle of 0.5-0.14 beside an inline value
    s_meta = json.loads((prefix / "s" / "meta.json").read_text())
    del s_meta["_metadata"]
    (prefix / "s" / "meta.json").write_text(json.dumps(s_meta, separators=(",", ":")))
    bookkeeping = {
        "memmap_prefix": PosixPath("/old/run/s"),
        "memmaped": False,
        "_share_non_tensor": False,
    }
    (prefix / "s" / "other.pickle").write_bytes(pickle.dumps({"_metadata": bookkeeping}))
    # "d": a plain JSON dict stored as a pickle
    d_meta = json.loads((prefix / "d" / "meta.json").read_text())
    value = d_meta.pop("data")
    (prefix / "d" / "meta.json").write_text(json.dumps(d_meta, separators=(",", ":")))
    (prefix / "d" / "other.pickle").write_bytes(pickle.dumps({"data": value}))
    return prefix


def test_convert_pickles_makes_json_data_loadable_without_pickle(tmp_path: Path) -> None:
    prefix = _pickled_checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match="Refusing to load pickled"):
        load(prefix, allow_pickle=False)
    report = upgrade(prefix, convert_pickles=True)
    assert sorted(report.converted_pickles) == ["d/other.pickle", "s/other.pickle"]
    assert report.kept_pickles == []
    assert not list(prefix.rglob("other.pickle"))
    td = load(prefix, allow_pickle=False)
    assert td["s"] == "hello" and td["d"] == {"a": 1, "b": [True, None]}
    assert json.loads((prefix / "s" / "meta.json").read_text())["_metadata"] is None
    manifest = json.loads((prefix / schema.MANIFEST_NAME).read_text())
    assert manifest["pickles"] == []


def test_convert_pickles_keeps_what_is_not_json_data(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "non_tensor_pickle")
    report = upgrade(prefix, convert_pickles=True)
    assert report.converted_pickles == []
    kept = "\n".join(report.kept_pickles)
    assert "point/other.pickle" in kept and "fixture_types.Point" in kept
    assert "bytes/other.pickle" in kept and "bytes" in kept
    manifest = json.loads((prefix / schema.MANIFEST_NAME).read_text())
    assert sorted(r["file"] for r in manifest["pickles"]) == [
        "bytes/other.pickle",
        "date/other.pickle",
        "point/other.pickle",
    ]
    assert diff_expected(load(prefix), dict(_case("0.8.3", "non_tensor_pickle").expected)) == []
    # still pickles: tensordict's default load warns (deliberately caught here) ...
    flip = re.escape(PICKLE_WARNING_FLIP)
    with pytest.warns(FutureWarning, match=rf"loading a pickled non-tensor field.*{flip}"):
        TensorDict.load_memmap(prefix)
    # ... and allow_pickle=False refuses
    with pytest.raises(RuntimeError, match="Refusing to load pickled"):
        load(prefix, allow_pickle=False)


def test_without_the_flag_nothing_is_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _pickled_checkpoint(tmp_path)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("upgrade unpickled without convert_pickles=True")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    report = upgrade(prefix)
    assert report.converted_pickles == []
    assert sorted(k.split(":")[0] for k in report.kept_pickles) == [
        "d/other.pickle",
        "s/other.pickle",
    ]


def test_non_tensor_stack_pickle(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    td = TensorDict(batch_size=[3])
    # pickled by every tensordict (a set: 0.15 pickles it, 0.14's orjson writer raises)
    td["st"] = tensordict.NonTensorStack(frozenset({1}), "b", "c")
    td.memmap(prefix)
    pkl = prefix / "st" / "pickle.pkl"
    pkl.write_bytes(pickle.dumps(["a", "b", "c"]))  # now plain JSON data
    report = upgrade(prefix, convert_pickles=True)
    assert report.converted_pickles == ["st/pickle.pkl"]
    meta = json.loads((prefix / "st" / "meta.json").read_text())
    assert meta["data"] == ["a", "b", "c"]
    assert load(prefix, allow_pickle=False).get("st").tolist() == ["a", "b", "c"]


# -- releases the corpus does not hold (layouts from format-notes.md) -------------------------

TD_TYPE = "<class 'tensordict._td.TensorDict'>"
NTD_TYPE = "<class 'tensordict.tensorclass.NonTensorData'>"


def _write_meta(path: Path, meta: dict[str, Any], *, compact: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    sep = (",", ":") if compact else None
    (path / "meta.json").write_text(json.dumps(meta, separators=sep))


def test_g2_stack_of_non_tensors_becomes_a_non_tensor_stack(tmp_path: Path) -> None:
    """0.3.x saved a stack of strings as a lazy stack of NonTensorData directories."""
    prefix = tmp_path / "ckpt"
    _write_meta(prefix, {"shape": [2], "device": "None", "_type": TD_TYPE})  # 0.3.0: "None"
    _write_meta(
        prefix / "ls", {"_type": "<class 'tensordict._lazy.LazyStackedTensorDict'>", "stack_dim": 0}
    )
    for i, value in enumerate(["a", "b"]):
        member = prefix / "ls" / str(i)
        _write_meta(
            member, {"_type": NTD_TYPE, "data": value, "_metadata": None, "_is_non_tensor": True}
        )
        _write_meta(member / "_tensordict", {"shape": [], "device": "cpu", "_type": TD_TYPE})
    assert "ls" not in load(prefix)  # what tensordict 0.15.3 makes of it: silently gone
    report = upgrade(prefix)
    assert report.from_generation == "G2"
    td = load(prefix)
    assert td.get("ls").tolist() == ["a", "b"] and td.device is None


def test_g3_non_tensor_stack_loses_its_vestigial_directories(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    _write_meta(
        prefix, {"lst": {"type": "NonTensorStack"}, "shape": [3], "device": "cpu", "_type": TD_TYPE}
    )
    nts = {
        "_type": "<class 'tensordict.tensorclass.NonTensorStack'>",
        "stack_dim": 0,
        "device": None,
    }
    _write_meta(prefix / "lst", {**nts, "data": ["x", "y", "z"]})
    for i in range(3):
        _write_meta(prefix / "lst" / str(i), {"shape": [], "device": "cpu", "_type": TD_TYPE})
    report = upgrade(prefix)
    assert report.from_generation == "G3"
    assert sorted(p.name for p in (prefix / "lst").iterdir()) == ["meta.json"]
    assert load(prefix).get("lst").tolist() == ["x", "y", "z"]


def test_tensorclass_subclass_bug_is_rewrapped(tmp_path: Path) -> None:
    """0.10-0.13 saved TensorClass-subclass instances as plain TensorDicts (#1722)."""
    prefix = copy_case(tmp_path, "0.12.4", "tensorclass_in_td")
    shutil.copytree(prefix / "tc" / "_tensordict", prefix / "bad")
    meta = json.loads((prefix / "meta.json").read_text())
    meta = {"bad": {"type": "FixtureTC"}, **meta}
    (prefix / "meta.json").write_text(json.dumps(meta, separators=(",", ":")))
    assert type(load(prefix)["bad"]).__name__ == "TensorDict"  # the bug, as tensordict reads it
    report = upgrade(prefix)
    assert any(p.code == "rewrapped-tensorclass" for p in report.problems)
    td = load(prefix)
    assert type(td["bad"]).__name__ == "FixtureTC"
    assert td["bad"].label == td["tc"].label == "episode-1"
    assert (td["bad"].obs == td["tc"].obs).all()


def test_g7_json_types_checkpoint(tmp_path: Path) -> None:
    """0.15.0-0.15.2: no format marker yet; json_types.json beside a types-only pickle."""
    prefix = tmp_path / "ckpt"
    source = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    source.memmap(prefix)
    meta = json.loads((prefix / "meta.json").read_text())
    for field in ("_format_version", "_class"):
        meta.pop(field, None)  # 0.14 - 0.15.2 write neither
    meta["p"] = {"type": "NonTensorData"}
    (prefix / "meta.json").write_text(json.dumps(meta))
    raw = pickle.dumps({"data": tuple})  # a container type: described by json_types.json
    _write_meta(prefix / "p", {"_type": NTD_TYPE, "_metadata": None, "_is_non_tensor": True})
    (prefix / "p" / "other.pickle").write_bytes(raw)
    types = {"types": {"data": "tuple"}, "pickle_sha256": hashlib.sha256(raw).hexdigest()}
    (prefix / "p" / "json_types.json").write_text(json.dumps(types))
    report = upgrade(prefix)
    assert (report.from_generation, report.steps) == ("G7", ["0007_g7_format_v1"])
    assert (prefix / "p" / "json_types.json").exists()  # kept: it still describes the pickle
    if READS_JSON_TYPES:
        td = load(prefix, allow_pickle=False)  # json_types.json: no pickle needed
    else:  # tensordict 0.14 knows no json_types.json: it would have to unpickle
        with pytest.raises(RuntimeError, match="Refusing to load pickled"):
            load(prefix, allow_pickle=False)
        td = tdckpt.load_memmap(prefix, allow_pickle=False)
    assert td["x"].shape == (3,) and td["p"] is tuple


# -- archives ----------------------------------------------------------------------------------


def test_archive_is_repacked_stored_and_replaced_atomically(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.14.3", "archive_deflate")
    old_ino = prefix.stat().st_ino
    report = upgrade(prefix)
    (backup,) = backups(prefix)
    assert backup.stat().st_ino == old_ino, "the backup is a hard link of the old archive"
    with zipfile.ZipFile(prefix) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        meta = json.loads(zf.read("meta.json"))
    assert meta["_format_version"] == 1
    assert report.steps[-1] == "0007_g7_format_v1"
    exp = dict(_case("0.14.3", "archive_deflate").expected)
    assert diff_expected(load(prefix), exp) == []


# -- crashes -----------------------------------------------------------------------------------


def _case(version: str, name: str) -> FixtureCase:
    (fc,) = fixture_cases(versions=[version], where=lambda c: c.name == name)
    return fc


FAULT_CASES = [("0.3.2", "nested"), ("0.14.3", "archive_stored")]


def _state_is_restorable(prefix: Path, original: Mapping[str, str], expected: Any) -> None:
    """Old or new tree intact at the prefix; or (mid-swap) the old one at the journal's backup."""
    if prefix.exists():
        if tree_digest(prefix) == original:
            return  # the old tree, untouched
        assert diff_expected(load(prefix), copy.deepcopy(expected)) == []
        return
    journal = json.loads((prefix.parent / f"{prefix.name}{JOURNAL_SUFFIX}").read_text())
    assert tree_digest(prefix.parent / journal["backup"]) == original


def _run_child(
    prefix: Path, *args: str, kill_after: float | None = None, wait_for_ops: bool = True
) -> int:
    """Run the child; with ``kill_after``, SIGKILL it that long after the upgrade started
    (``wait_for_ops``: after its first file operation; else after the call, while it plans
    and creates its journal)."""
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "_upgrade_child.py"), str(prefix), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
        text=True,
    )
    if kill_after is not None:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "start": imports done, upgrade begins
        assert line.strip() == "start", line + (proc.stderr.read() if proc.stderr else "")
        if wait_for_ops:
            line = proc.stdout.readline()
            assert line.startswith(("op ", "done")), line
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, -signal.SIGKILL), err
    return proc.returncode


def _trials() -> list[tuple[int, str, str, bool, bool]]:
    """(seed, version, case, random instant?, fallback swap?) - TDCKPT_FAULT_TRIALS of them."""
    n = int(os.environ.get("TDCKPT_FAULT_TRIALS", "8"))
    return [
        (seed, *FAULT_CASES[seed % len(FAULT_CASES)], seed % 4 >= 2, seed % 3 == 1)
        for seed in range(n)
    ]


@pytest.mark.parametrize(
    ("seed", "version", "name", "random_instant", "no_exchange"),
    _trials(),
    ids=lambda v: str(v) if not isinstance(v, bool) else ("T" if v else "F"),
)
def test_sigkill_at_any_point_converges(
    seed: int, version: str, name: str, random_instant: bool, no_exchange: bool, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    fc = _case(version, name)
    prefix = copy_case(tmp_path, fc)
    original = tree_digest(prefix)
    expected = dict(fc.expected)
    n_ops = len(upgrade(prefix, dry_run=True).operations)
    keep_backup = rng.random() < 0.75
    args = [*(["--no-exchange"] if no_exchange else []), *([] if keep_backup else ["--no-backup"])]
    if random_instant:
        sleep = 0.004
        if rng.random() < 0.25:  # while planning / creating the journal / staging the first file
            _run_child(
                prefix,
                "--sleep",
                str(sleep),
                *args,
                kill_after=rng.uniform(0, 0.05),
                wait_for_ops=False,
            )
        else:  # anywhere among the file operations, the swap and the clean-up
            _run_child(
                prefix, "--sleep", str(sleep), *args, kill_after=rng.uniform(0, n_ops * sleep)
            )
    else:
        kill_at = [n_ops - 1, n_ops, 1][seed % 3] if seed < 3 else rng.randint(1, n_ops)
        _run_child(prefix, "--kill-at", str(kill_at), *args)
    _state_is_restorable(prefix, original, expected)
    # re-running finishes (or undoes and redoes) the upgrade
    report = upgrade(prefix, backup=keep_backup)
    assert leftovers(prefix) == []
    assert diff_expected(load(prefix), copy.deepcopy(expected)) == []
    found = backups(prefix)
    if keep_backup:
        assert len(found) == 1 and tree_digest(found[0]) == original, report
    else:
        assert found == []
    assert upgrade(prefix).operations == []
