"""Cross-version corpus: tdckpt on checkpoints of the releases the main corpus lacks.

``tests/fixtures/extra/<version>/`` holds the main corpus's case set written by tensordict
0.1.2, 0.5.0, 0.6.2, 0.7.2, 0.9.1, 0.10.0, 0.11.0, 0.14.0, 0.15.0, 0.15.1 and 0.15.2 themselves
(``fixtures/extra/README.md``; ``generate.py`` wrote it), plus four cases for layouts only these
releases write (from_pytree containers, NonTensorStacks, re-saved NonTensorData, the
``TensorClass`` subclass syntax). For every case:

* ``tdckpt.load_memmap(prefix, robust_key=None, allow_pickle=True)`` restores the manifest's
  ``expected``, excusing only what the writer destroyed (``conftest.writer_losses``), and warns
  exactly when the checkpoint lost content, with one TdckptWarning naming every loss;
* ``tdckpt.validate`` finds no error and ``tdckpt.inspect`` names a generation consistent with
  the release that wrote it (format-notes.md §7);
* after ``tdckpt.upgrade``, plain tensordict 0.15.3 ``TensorDict.load_memmap`` restores the same.

Also: the corpus is what its manifests say, it is small, and its ``expected`` records are the
main corpus's (same keys, dtypes and bytes: the same cases, only the writer differs).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _expected import assert_matches_expected
from _restore_helpers import objects
from _tdversion import READS_JSON_TYPES
from conftest import (
    EXTRA_FIXTURES,
    EXTRA_VERSIONS,
    VERSIONS,
    FixtureCase,
    case_id,
    copy_case,
    fixture_cases,
    load_manifest,
    writer_losses,
)

tensordict = pytest.importorskip("tensordict")
import fixture_types  # noqa: E402,F401  (the corpus's pickled Point and tensorclass)
from tensordict import TensorDict  # noqa: E402

import tdckpt  # noqa: E402
from tdckpt._read.detect import detect, gen_name, gen_number  # noqa: E402
from tdckpt._read.opener import open_storage  # noqa: E402
from tdckpt._read.tree import read_tree  # noqa: E402
from tdckpt.errors import ValidationError  # noqa: E402
from tdckpt.warnings import TdckptWarning  # noqa: E402

CASES = fixture_cases(root=EXTRA_FIXTURES)
LOST_WARNING = "the tensordict release that wrote it had already lost some content: "


def release_generation(version: str) -> int:
    """The layout generation a tensordict release writes (format-notes.md §7)."""
    release = tuple(int(p) for p in version.split("."))
    firsts = [(0, 3), (0, 4), (0, 5), (0, 13), (0, 14), (0, 15), (0, 15, 3)]
    return 1 + sum(release >= first for first in firsts)


def _restore(prefix: Path) -> tuple[Any, list[warnings.WarningMessage]]:
    """tdckpt's restore; every warning is caught here and checked by the caller."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = tdckpt.load_memmap(prefix, robust_key=None, allow_pickle=True)
    return obj, caught


def _devices(obj: Any) -> dict[tuple[Any, ...], str]:
    """The device of every collection and non-tensor wrapper of ``obj``, by key path."""
    return {
        path: str(o.device)
        for path, o in objects(obj).items()
        if not isinstance(o, torch.Tensor) and hasattr(o, "device")
    }


def _refused_upgrade(fc: FixtureCase) -> str | None:
    """Why no current layout can hold this case (a child collection named 'meta.json')."""
    entry = fc.expected.get("entries", {}).get("meta.json")
    return "'meta.json'" if entry is not None and entry.get("kind") == "td" else None


# -- the corpus itself -----------------------------------------------------------------------


def test_corpus_covers_the_missing_releases() -> None:
    assert set(EXTRA_VERSIONS) >= {"0.5.0", "0.10.0", "0.14.0", "0.15.0", "0.15.2"}
    for version in EXTRA_VERSIONS:
        manifest = load_manifest(version, EXTRA_FIXTURES)
        assert manifest["tensordict_version"] == version
        assert manifest["torch_version"].startswith("2.13.0")
    total = sum(p.stat().st_size for p in EXTRA_FIXTURES.rglob("*") if p.is_file())
    assert total < 3_000_000, f"the cross-version corpus grew to {total} bytes"


@pytest.mark.parametrize("fc", CASES, ids=case_id)
def test_case_is_on_disk_as_recorded(fc: FixtureCase) -> None:
    case_dir = fc.target.parent
    listed = {f["path"]: f["size"] for f in fc.case["files"]}
    on_disk = {
        p.relative_to(case_dir).as_posix(): p.stat().st_size
        for p in case_dir.rglob("*")
        if p.is_file()
    }
    assert on_disk == listed
    outside = {p for p in on_disk if not p.startswith(fc.case["target"])}
    assert outside == set(fc.case["files_outside_target"])


def _main_corpus_record(name: str) -> dict[str, Any]:
    """The main corpus's ``expected`` for a case, every entry any of its releases wrote."""
    records = [
        load_manifest(v)["cases"][name]["expected"]
        for v in reversed(VERSIONS)
        if load_manifest(v)["cases"].get(name, {}).get("status") == "written"
    ]
    merged = dict(records[0])
    if "entries" in merged:
        entries: dict[str, Any] = {}
        for rec in records:
            for key, sub in rec["entries"].items():
                assert entries.setdefault(key, sub) == sub, f"{name}[{key!r}] differs by release"
        merged["entries"] = entries
    return merged


@pytest.mark.parametrize(
    "fc", [fc for fc in CASES if fc.name in load_manifest("0.15.3")["cases"]], ids=case_id
)
def test_expected_records_are_the_main_corpus_cases(fc: FixtureCase) -> None:
    """Same case, same content: only the writer differs (what generate.py promises)."""
    main = _main_corpus_record(fc.name)
    ours = dict(fc.expected)
    if "entries" in main:
        excluded = set(fc.case.get("excluded_entries", {}))
        assert set(ours["entries"]) == set(main["entries"]) - excluded, fc.id
        main["entries"] = {k: main["entries"][k] for k in ours["entries"]}
    assert json.dumps(ours) == json.dumps(main)


# -- restore, validate, inspect ----------------------------------------------------------------


@pytest.mark.parametrize("fc", CASES, ids=case_id)
def test_restore_validate_inspect(fc: FixtureCase, tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, fc)
    true_gen = release_generation(fc.version)

    info = tdckpt.inspect(prefix)
    with open_storage(prefix) as storage:
        found = detect(read_tree(storage), storage=storage)
    assert found.consistent and found.low <= true_gen <= found.high, (
        f"{fc.id}: written by a G{true_gen} release, detected [G{found.low}, G{found.high}]"
    )
    assert info.generation == gen_name(found.low)  # the oldest generation the files allow
    assert gen_number(info.generation) <= true_gen
    if true_gen == 1 or fc.case["format"] == "archive":
        assert found.low == true_gen if true_gen == 1 else found.low >= 6, fc.id
    report = tdckpt.validate(prefix)
    assert report.ok, [str(p) for p in report.problems]

    exp, lost = writer_losses(fc)
    obj, caught = _restore(prefix)
    assert_matches_expected(obj, exp, lost=lost)
    # One TdckptWarning exactly when the checkpoint lost content, naming every loss; nothing else
    # (the pickles are acknowledged with allow_pickle=True: no FutureWarning).
    assert [w.category for w in caught] == ([TdckptWarning] if info.lost else [])
    if caught:
        message = str(caught[0].message)
        assert message.startswith(f"{prefix}: restored what the checkpoint holds, but ")
        assert LOST_WARNING in message
        assert all(loss in message for loss in info.lost[:10])
        assert caught[0].filename == __file__, "the warning points at the caller"
    if lost:  # every documented writer loss is one the checkpoint reports: a loss, or (a list
        # that may have been a tuple, which every tensordict writes) validate's json-list info
        listed = {p.code for p in report.problems if p.severity == "info"}
        assert info.lost or (lost == ["tuple"] and "json-list" in listed), (
            f"{fc.id}: lost {lost} but inspect reports no loss"
        )


# -- upgrade, then plain tensordict 0.15.3 -----------------------------------------------------


@pytest.mark.parametrize("fc", CASES, ids=case_id)
def test_upgrade_then_tensordict_restores(fc: FixtureCase, tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, fc)
    ours, _ = _restore(copy_case(tmp_path / "ours", fc))
    refused = _refused_upgrade(fc)
    if refused:
        with pytest.raises(ValidationError, match=refused):
            tdckpt.upgrade(prefix)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = tdckpt.upgrade(prefix)
    assert report.to_generation == "G8"
    assert report.from_generation == tdckpt.inspect(copy_case(tmp_path / "again", fc)).generation
    assert tdckpt.validate(prefix).ok and tdckpt.inspect(prefix).generation == "G8"
    if fc.name == "float8_dtypes":  # tensordict 0.15.3 writes float8 but cannot read it back
        with pytest.raises(KeyError, match="float8"):
            TensorDict.load_memmap(prefix, allow_pickle=True)
        return
    exp, lost = writer_losses(fc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        theirs = TensorDict.load_memmap(prefix, allow_pickle=True)
    assert_matches_expected(theirs, exp, lost=lost)
    # the same objects on the same devices (a NonTensorData takes its tensordict's device)
    assert _devices(ours) == _devices(theirs)
    assert tdckpt.upgrade(prefix).operations == [], "a second upgrade is a no-op"


@pytest.mark.parametrize(
    "fc",
    [fc for fc in CASES if fc.name == "non_tensor_types" and fc.version.startswith("0.15.")],
    ids=case_id,
)
def test_json_types_need_no_pickle(fc: FixtureCase, tmp_path: Path) -> None:
    """0.15.0-0.15.2's json_types.json names the classes other.pickle holds: no unpickling."""
    prefix = copy_case(tmp_path, fc)
    assert (prefix / "b" / "_pytree_type" / "json_types.json").is_file()
    td = tdckpt.load_memmap(prefix, robust_key=None, allow_pickle=False)
    assert td["_pytree_type"] is dict and td["b", "_pytree_type"] is tuple
    if READS_JSON_TYPES:
        theirs = TensorDict.load_memmap(prefix, allow_pickle=False)
        assert theirs["_pytree_type"] is dict and theirs["b", "_pytree_type"] is tuple
    else:  # tensordict 0.14 knows no json_types.json: it would have to unpickle
        with pytest.raises(RuntimeError, match="Refusing to load pickled"):
            TensorDict.load_memmap(prefix, allow_pickle=False)


def test_a_refusal_under_robust_key_true_points_to_the_same_report_and_the_way_out(
    tmp_path: Path,
) -> None:
    """A checkpoint of raw key names (0.8.3, a key holding '/') refused under the default
    robust_key=True: the message sent the user to `tdckpt validate <prefix>`, which reads
    with the detected encoding and said ok. It now gives the same policy to validate, and
    says that such a checkpoint reads with robust_key=None."""
    import subprocess
    import sys

    from conftest import subprocess_env

    from tdckpt.errors import ValidationError

    prefix = copy_case(tmp_path, "0.8.3", "odd_nested__default")
    with pytest.raises(ValidationError) as info:
        tdckpt.load_memmap(prefix)
    message = str(info.value)
    assert f"tdckpt validate {prefix} --robust-key true" in message
    assert "reads with robust_key=None (detected) or False" in message
    out = subprocess.run(
        [sys.executable, "-m", "tdckpt", "validate", str(prefix), "--robust-key", "true"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert out.returncode == 1, out.stdout + out.stderr  # the same refusal, as the hint says
    with pytest.warns(TdckptWarning, match="had already lost some content"):
        assert tdckpt.load_memmap(prefix, robust_key=None) is not None
