"""The fixture corpus and its test harness are right.

* every case the manifests list as written is on disk, file for file;
* ``expected`` sha256 digests are the digests of the leaf files' raw bytes (every version);
* tensordict 0.15.3 itself restores the 0.14.3 / 0.15.3 cases that the manifests say it
  restores, and :func:`assert_matches_expected` agrees, for every record shape;
* the harness reaches the manifest's verdict (match / differs) for every 0.15.3 load of every
  version, and catches wrong values, dtypes, shapes, keys, types, batch sizes and stack members;
* ``lost=`` excuses exactly the documented writer losses, nowhere else.
"""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from _expected import (
    assert_matches_expected,
    diff_expected,
    iter_expected_tensors,
    tensor_sha256,
)
from _tdversion import PICKLE_WARNING_FLIP, as_installed_warning
from conftest import (
    FIXTURES,
    VERSIONS,
    FixtureCase,
    case_id,
    copy_case,
    fixture_cases,
    load_manifest,
    tree_digest,
)

tensordict = pytest.importorskip("tensordict")
import fixture_types  # noqa: E402  (importable because conftest put tests/ on sys.path)
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict  # noqa: E402

CURRENT = "0.15.3"
PICKLE_WARNING = "is loading a pickled non-tensor field"
LOAD_ALLOW_PICKLE = "TensorDict.load_memmap(prefix, allow_pickle=True)"
LOAD_DEFAULT = "TensorDict.load_memmap(prefix)"

#: The loads the manifests record, as callables on a prefix.
CALLS: dict[str, Callable[[Path], Any]] = {
    LOAD_DEFAULT: lambda p: TensorDict.load_memmap(p),
    LOAD_ALLOW_PICKLE: lambda p: TensorDict.load_memmap(p, allow_pickle=True),
    "TensorDict.load_memmap(prefix, robust_key=True)": lambda p: TensorDict.load_memmap(
        p, robust_key=True
    ),
    "TensorDict.load_memmap(prefix, robust_key=False)": lambda p: TensorDict.load_memmap(
        p, robust_key=False
    ),
    "LazyStackedTensorDict.load_memmap(prefix)": lambda p: LazyStackedTensorDict.load_memmap(p),
    "FixtureTC.load_memmap(prefix)": lambda p: fixture_types.FixtureTC.load_memmap(p),
}


def _current_reload(fc: FixtureCase, call: str) -> Mapping[str, Any] | None:
    return fc.reload(CURRENT, call)


def _restored_ok(fc: FixtureCase) -> bool:
    """The manifest says tensordict 0.15.3 restores this case exactly (default or pickle call)."""
    rec = _current_reload(fc, LOAD_ALLOW_PICKLE) or _current_reload(fc, LOAD_DEFAULT)
    return bool(rec and rec["status"] == "ok" and rec.get("content_matches") is True)


RESTORED_BY_CURRENT = fixture_cases(versions=["0.14.3", CURRENT], where=_restored_ok)


def _warning_set(records: list[warnings.WarningMessage]) -> set[tuple[str, str]]:
    return {(w.category.__name__, str(w.message)) for w in records}


def _manifest_warnings(rec: Mapping[str, Any]) -> set[tuple[str, str]]:
    """The warnings a manifest recorded (with 0.15.3), worded as the installed tensordict."""
    return {(w["category"], as_installed_warning(w["message"])) for w in rec.get("warnings", [])}


def _load_recording(call: Callable[[Path], Any], target: Path) -> tuple[Any, set[tuple[str, str]]]:
    """Run a load, deliberately recording every warning (pytest turns warnings into errors)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = call(target)
    return obj, _warning_set(caught)


def _load(version: str, name: str, tmp_path: Path, **kwargs: Any) -> Any:
    target = copy_case(tmp_path, version, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these loads are known to be warning-free
        return TensorDict.load_memmap(target, allow_pickle=True, **kwargs)


def _expected(version: str, name: str) -> dict[str, Any]:
    return copy.deepcopy(load_manifest(version)["cases"][name]["expected"])


# ----------------------------------------------------------------------------- the corpus itself


def test_corpus_versions_and_provenance() -> None:
    assert VERSIONS == ("0.2.1", "0.3.2", "0.4.0", "0.8.3", "0.12.4", "0.13.0", "0.14.3", "0.15.3")
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("> **PROVENANCE.**")
    assert "unmodified, on 2026-11-30" in readme
    assert not (FIXTURES / "fixture_types.py").exists(), (
        "tests/fixture_types.py is the project's copy"
    )
    for version in VERSIONS:
        assert load_manifest(version)["tensordict_version"] == version


@pytest.mark.parametrize("fc", fixture_cases(), ids=case_id)
def test_written_case_is_on_disk(fc: FixtureCase) -> None:
    case_dir = fc.target.parent
    if fc.case["format"] == "archive":
        assert fc.target.is_file(), f"{fc.id}: archive {fc.target} missing"
    else:
        assert fc.target.is_dir(), f"{fc.id}: prefix directory {fc.target} missing"
    for entry in fc.case["files"]:
        path = case_dir / entry["path"]
        if entry["path"].endswith("/"):
            assert path.is_dir(), f"{fc.id}: directory {entry['path']} missing"
            continue
        assert path.is_file(), f"{fc.id}: file {entry['path']} missing"
        assert path.stat().st_size == entry["size"], f"{fc.id}: {entry['path']} has the wrong size"
    for name in fc.case["files_outside_target"]:
        assert (case_dir / name).exists(), f"{fc.id}: {name} (written outside the prefix) missing"
    if fc.target.is_dir():  # and nothing the manifest does not list
        on_disk = set(tree_digest(fc.target))
        listed = {e["path"].removeprefix(f"{fc.case['target']}/") for e in fc.case["files"]}
        assert on_disk <= listed, f"{fc.id}: files not in the manifest: {sorted(on_disk - listed)}"


def _plain_td_directory(fc: FixtureCase) -> bool:
    # Archives, tensorclasses and lazy stacks are checked through the restores instead.
    return fc.target.is_dir() and fc.expected["type"] == "TensorDict"


@pytest.mark.parametrize("fc", fixture_cases(where=_plain_td_directory), ids=case_id)
def test_expected_sha256_is_the_leaf_file_bytes(fc: FixtureCase) -> None:
    """The digest definition holds on disk for every version (float8 included)."""
    checked = 0
    for path, rec in iter_expected_tensors(fc.expected):
        if len(path) != 1 or not re.fullmatch(r"[A-Za-z0-9_]+", path[0]):
            continue  # nested or encoded names: the restore tests cover them
        leaf = fc.target / f"{path[0]}.memmap"
        if rec["nbytes"] == 0 and not leaf.exists():
            continue  # zero-element leaves have no file (0.3+)
        data = leaf.read_bytes()
        assert len(data) >= rec["nbytes"], f"{fc.id}: {leaf.name} is shorter than the tensor"
        assert hashlib.sha256(data[: rec["nbytes"]]).hexdigest() == rec["sha256"], (
            f"{fc.id}: {leaf.name}"
        )
        checked += 1
    if fc.name in ("flat", "exotic_dtypes", "float8_dtypes"):
        assert checked, f"{fc.id}: no leaf was checked"


def test_fixture_types_match_the_corpus(tmp_path: Path) -> None:
    assert fixture_types.FixtureTC.__module__ == "fixture_types"
    assert str(fixture_types.FixtureTC) == "<class 'fixture_types.FixtureTC'>"
    meta = json.loads((FIXTURES / CURRENT / "tensorclass" / "ckpt" / "meta.json").read_text())
    assert meta["_type"] == str(fixture_types.FixtureTC)
    fields = list(load_manifest(CURRENT)["cases"]["tensorclass"]["expected"]["entries"])
    assert (
        list(fixture_types.FixtureTC.__dataclass_fields__)
        == fields
        == ["obs", "reward", "label", "extra"]
    )
    point = fixture_types.Point(1, 2)
    assert pickle.loads(pickle.dumps(point)) == point
    assert repr(point) == "Point(x=1, y=2)"
    raw = (
        FIXTURES / CURRENT / "non_tensor_pickle" / "ckpt" / "point" / "other.pickle"
    ).read_bytes()
    assert pickle.loads(raw)["data"] == point  # the checked-in pickle resolves to our class


# ------------------------------------------------------------ positive: tensordict 0.15.3


def test_selection_covers_every_record_shape() -> None:
    names = {fc.id for fc in RESTORED_BY_CURRENT}
    for must in (
        "flat",
        "exotic_dtypes",
        "nested",
        "lazy_stack",
        "tensorclass",
        "tensorclass_in_td",
        "non_tensor_json",
        "non_tensor_pickle",
        "nested_tensor_strided",
        "empty_td",
        "zero_numel",
        "archive_stored",
        "archive_deflate",
        "odd_keys__default",
    ):
        assert f"{CURRENT}-{must}" in names
        assert f"0.14.3-{must}" in names
    assert f"{CURRENT}-float8_dtypes" not in names  # 0.15.3 cannot read float8 back
    assert f"{CURRENT}-non_tensor_lossy" not in names  # tuple -> list


@pytest.mark.parametrize("fc", RESTORED_BY_CURRENT, ids=case_id)
def test_tensordict_restores_expected(fc: FixtureCase, tmp_path: Path) -> None:
    target = copy_case(tmp_path, fc)
    before = tree_digest(target.parent)
    recorded = _current_reload(fc, LOAD_ALLOW_PICKLE)
    if recorded is None:  # no pickle in this case: the default call stands for it
        recorded = _current_reload(fc, LOAD_DEFAULT)
        assert recorded is not None
        want = {w for w in _manifest_warnings(recorded) if PICKLE_WARNING not in w[1]}
    else:
        want = _manifest_warnings(recorded)
    obj, got = _load_recording(CALLS[LOAD_ALLOW_PICKLE], target)
    assert got == want, f"{fc.id}: warnings {got} != recorded {want}"
    assert type(obj).__name__ == recorded["type"].split(":")[-1].rsplit(".", 1)[-1]
    assert_matches_expected(obj, fc.expected)
    assert tree_digest(target.parent) == before, "loading must not modify the prefix"


@pytest.mark.parametrize(
    "fc",
    fixture_cases(
        versions=["0.14.3", CURRENT],
        where=lambda fc: _current_reload(fc, LOAD_ALLOW_PICKLE) is not None and _restored_ok(fc),
    ),
    ids=case_id,
)
def test_default_load_warns_only_for_pickles(fc: FixtureCase, tmp_path: Path) -> None:
    """Without allow_pickle, 0.15.3 emits its FutureWarning exactly when the manifest says so."""
    target = copy_case(tmp_path, fc)
    recorded = _current_reload(fc, LOAD_DEFAULT)
    assert recorded is not None and recorded["status"] == "ok"
    if any(PICKLE_WARNING in msg for _, msg in _manifest_warnings(recorded)):
        flip = re.escape(PICKLE_WARNING_FLIP)
        with pytest.warns(FutureWarning, match=rf"loading a pickled non-tensor field.*{flip}"):
            obj = TensorDict.load_memmap(target)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            obj = TensorDict.load_memmap(target)
    assert_matches_expected(obj, fc.expected)


# ------------------------------------------------------------ the manifests' verdicts


def _verdict_params() -> list[Any]:
    params = []
    for fc in fixture_cases():
        for rec in fc.case[f"reload_by_{CURRENT}"]["calls"]:
            if rec["status"] == "ok":
                params.append(pytest.param(fc, rec["call"], id=f"{fc.id}-{rec['call']}"))
    return params


@pytest.mark.parametrize(("fc", "call"), _verdict_params())
def test_harness_reaches_the_manifest_verdict(fc: FixtureCase, call: str, tmp_path: Path) -> None:
    """For every load by 0.15.3 that the manifests record as ok, match/differs agrees."""
    rec = _current_reload(fc, call)
    assert rec is not None
    obj, got_warnings = _load_recording(CALLS[call], copy_case(tmp_path, fc))
    assert got_warnings == _manifest_warnings(rec)
    problems = diff_expected(obj, fc.expected)
    if rec["content_matches"]:
        assert problems == []
        return
    assert problems, f"manifest says the content differs ({rec['differences']}), harness saw none"
    joined = "\n".join(problems)
    for difference in rec["differences"]:
        m = re.search(r"(?:missing|unexpected) key (.+)$", difference)
        if m:
            assert m.group(1) in joined, f"harness did not report {difference!r}:\n{joined}"


# ----------------------------------------------------------------------------- negative


def test_catches_wrong_value(tmp_path: Path) -> None:
    td = _load(CURRENT, "flat", tmp_path).clone()
    td["f32"][1, 0] = 42.0
    with pytest.raises(AssertionError) as err:
        assert_matches_expected(td, _expected(CURRENT, "flat"))
    msg = str(err.value)
    assert "<root>['f32']: sha256 of the raw bytes" in msg
    assert "<root>['f32']: values [[-0.5, -0.25], [42.0, 0.25]" in msg
    assert "(2)" in msg  # exactly two problems: digest and values
    # A record whose values disagree with its digest is caught on the values alone.
    exp = _expected(CURRENT, "flat")
    exp["entries"]["i64"]["values"][2] = 7
    with pytest.raises(
        AssertionError,
        match=r"<root>\['i64'\]: values \[-1, 0, 1099511627783\] != expected \[-1, 0, 7\]",
    ):
        assert_matches_expected(_load(CURRENT, "flat", tmp_path / "again"), exp)


def test_catches_wrong_dtype_and_shape(tmp_path: Path) -> None:
    td = _load(CURRENT, "flat", tmp_path).clone()
    td["i64"] = td["i64"].to(torch.int32)
    td["u8"] = td["u8"][:, :2]
    problems = diff_expected(td, _expected(CURRENT, "flat"))
    assert problems == [
        "<root>['i64']: dtype torch.int32 != expected torch.int64",
        "<root>['u8']: shape [3, 2] != expected [3, 3]",
    ]


def test_catches_missing_and_unexpected_keys(tmp_path: Path) -> None:
    td = _load(CURRENT, "nested", tmp_path).clone()
    del td["lvl1", "lvl2", "y"]
    td["lvl1", "extra"] = torch.zeros(3, 2)
    problems = diff_expected(td, _expected(CURRENT, "nested"))
    assert problems == [
        "<root>['lvl1']['lvl2']: missing key 'y' (expected tensor torch.int32[3, 2, 4])",
        "<root>['lvl1']: unexpected key 'extra' (tensor torch.float32[3, 2])",
    ]


def test_catches_wrong_batch_size_type_and_non_tensor(tmp_path: Path) -> None:
    td = _load(CURRENT, "tensorclass_in_td", tmp_path)
    exp = _expected(CURRENT, "tensorclass_in_td")
    exp["entries"]["tc"]["batch_size"] = [4]
    exp["entries"]["tc"]["entries"]["label"]["repr"] = "'episode-2'"
    exp["entries"]["tc"]["type"] = "tensorclass:fixture_types.Other"
    assert diff_expected(td, exp) == [
        "<root>['tc']: type 'tensorclass:fixture_types.FixtureTC'"
        " != expected 'tensorclass:fixture_types.Other'",
        "<root>['tc']: batch_size [3] != expected [4]",
        "<root>['tc']['label']: value 'episode-1' != expected 'episode-2'",
    ]
    plain = TensorDict({"obs": torch.zeros(3, 2)}, batch_size=[3])
    exp = _expected(CURRENT, "tensorclass")
    problems = diff_expected(plain, exp)
    assert (
        problems[0] == "<root>: type 'TensorDict' != expected 'tensorclass:fixture_types.FixtureTC'"
    )
    assert "<root>: missing key 'label' (expected non-tensor builtins.str 'episode-1')" in problems


def test_catches_lazy_stack_differences(tmp_path: Path) -> None:
    stack = _load(CURRENT, "lazy_stack", tmp_path)
    exp = _expected(CURRENT, "lazy_stack")
    exp["stack_dim"] = 1
    exp["items"][1]["entries"]["sub"]["entries"]["het"]["shape"] = [2, 4]
    assert diff_expected(stack, exp) == [
        "<root>: stack_dim 0 != expected 1",
        "<root>[#1]['sub']['het']: shape [2, 3] != expected [2, 4]",
    ]
    exp = _expected(CURRENT, "lazy_stack")
    exp["items"].append(copy.deepcopy(exp["items"][0]))
    assert "<root>: 3 lazy-stack members != expected 4" in diff_expected(stack, exp)
    assert diff_expected(stack[0], _expected(CURRENT, "lazy_stack"))[0].startswith(
        "<root>: expected LazyStackedTensorDict of 3 members, got TensorDict"
    )


def test_catches_nested_tensor_differences(tmp_path: Path) -> None:
    td = _load(CURRENT, "nested_tensor_strided", tmp_path)
    exp = _expected(CURRENT, "nested_tensor_strided")
    exp["entries"]["nt"]["components"][2]["values"] = [21.0]
    exp["entries"]["nt"]["components"][2]["sha256"] = "0" * 64
    problems = diff_expected(td, exp)
    digest = tensor_sha256(torch.tensor([20.0]))
    assert problems == [
        f"<root>['nt']['<component 2>']: sha256 of the raw bytes {digest} != expected {'0' * 64}",
        "<root>['nt']['<component 2>']: values [20.0] != expected [21.0]",
    ]
    td = TensorDict({"nt": torch.zeros(3), "dense": td["dense"]}, batch_size=[3])
    assert diff_expected(td, _expected(CURRENT, "nested_tensor_strided")) == [
        "<root>['nt']: expected nested tensor (torch.strided, torch.float32),"
        " got tensor torch.float32[3]"
    ]


def test_jagged_record_is_supported() -> None:
    """Jagged nested tensors are recorded (no writer can save them); the harness compares them."""
    exp = _expected(CURRENT, "nested_tensor_jagged")
    comps = [
        torch.tensor(c["values"], dtype=torch.float32) for c in exp["entries"]["nt"]["components"]
    ]
    td = TensorDict(
        {
            "nt": torch.nested.nested_tensor(comps, layout=torch.jagged),
            "dense": torch.tensor([1, 2, 3]),
        },
        batch_size=[3],
    )
    assert_matches_expected(td, exp)
    with warnings.catch_warnings():  # torch warns (once per process) about the strided prototype
        warnings.filterwarnings(
            "ignore", "The PyTorch API of nested tensors is in prototype", UserWarning
        )
        td["nt"] = torch.nested.nested_tensor(comps, layout=torch.strided)
    assert diff_expected(td, exp) == [
        "<root>['nt']: nested layout torch.strided != expected torch.jagged"
    ]


# ----------------------------------------------------------------------------- plain dicts


def _to_plain(obj: Any) -> Any:
    """The tensordict-free form: dicts, member lists, tensors and Python values."""
    if isinstance(obj, NonTensorData):
        return obj.data
    if isinstance(obj, LazyStackedTensorDict):
        return [_to_plain(member) for member in obj.tensordicts]
    if tensordict.is_tensorclass(obj):
        inner = obj._tensordict
        return {k: _to_plain(inner.get(k)) for k in inner.keys()}  # noqa: SIM118 (iter = batch dim)
    if isinstance(obj, tensordict.TensorDictBase):
        return {k: _to_plain(obj.get(k)) for k in obj.keys()}  # noqa: SIM118
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    return obj


@pytest.mark.parametrize(
    "name", ["nested", "lazy_stack", "tensorclass_in_td", "non_tensor_pickle", "zero_numel"]
)
def test_plain_dict_form(name: str, tmp_path: Path) -> None:
    plain = _to_plain(_load(CURRENT, name, tmp_path))
    assert isinstance(plain, (dict, list))
    assert_matches_expected(plain, _expected(CURRENT, name))


def test_plain_dict_form_catches_differences(tmp_path: Path) -> None:
    plain = _to_plain(_load(CURRENT, "tensorclass_in_td", tmp_path))
    plain["tc"]["extra"] = {"k": 2}
    del plain["x"]
    plain["tc"]["obs"] = plain["tc"]["obs"].double()
    assert diff_expected(plain, _expected(CURRENT, "tensorclass_in_td")) == [
        "<root>['tc']['obs']: dtype torch.float64 != expected torch.float32",
        "<root>['tc']['extra']: value {'k': 2} != expected {'k': 1}",
        "<root>: missing key 'x' (expected tensor torch.int64[3])",
    ]


@pytest.mark.parametrize("version", [v for v in VERSIONS if v != "0.2.1"])
def test_float8_read_from_raw_bytes(version: str, tmp_path: Path) -> None:
    """No tensordict reads float8 back; the bytes on disk are intact and the harness checks them."""
    target = copy_case(tmp_path, version, "float8_dtypes")
    exp = _expected(version, "float8_dtypes")
    plain = {}
    for key, rec in exp["entries"].items():
        raw = bytearray((target / f"{key}.memmap").read_bytes()[: rec["nbytes"]])
        plain[key] = torch.frombuffer(
            raw, dtype=getattr(torch, rec["dtype"].removeprefix("torch."))
        ).reshape(rec["shape"])
    assert_matches_expected(plain, exp)
    plain["f8e4m3"] = plain["f8e4m3"].view(torch.int8)
    assert diff_expected(plain, exp) == [
        "<root>['f8e4m3']: dtype torch.int8 != expected torch.float8_e4m3fn"
    ]


# ----------------------------------------------------------------------------- lost=


def _load_lossy(version: str, tmp_path: Path) -> Any:
    target = copy_case(tmp_path, version, "non_tensor_lossy")
    with pytest.warns(FutureWarning, match=PICKLE_WARNING):  # int_keys is pickled
        return TensorDict.load_memmap(target)


def test_lost_accepts_documented_writer_losses_only_there(tmp_path: Path) -> None:
    # 0.14.3 writes orjson: NaN and inf become null, the tuple a list.
    td = _load_lossy("0.14.3", tmp_path)
    exp = _expected("0.14.3", "non_tensor_lossy")
    assert diff_expected(td, exp) == [
        "<root>['f_nan']: python type builtins.NoneType != expected builtins.float (value None)",
        "<root>['f_inf']: python type builtins.NoneType != expected builtins.float (value None)",
        "<root>['tuple']: python type builtins.list != expected builtins.tuple (value [1, 'two'])",
    ]
    assert_matches_expected(td, exp, lost=("f_nan", "f_inf", "tuple"))
    with pytest.raises(AssertionError, match=r"<root>\['tuple'\]"):
        assert_matches_expected(td, exp, lost=("f_nan", "f_inf"))
    # 0.15.3 writes stdlib json: NaN survives, the tuple does not. An exact value is fine too.
    td = _load_lossy(CURRENT, tmp_path / "current")
    assert_matches_expected(
        td, _expected(CURRENT, "non_tensor_lossy"), lost=("f_nan", "f_inf", "tuple")
    )


def test_lost_rejects_other_differences(tmp_path: Path) -> None:
    td = _load_lossy("0.14.3", tmp_path).clone()
    exp = _expected("0.14.3", "non_tensor_lossy")
    td.set_non_tensor("f_nan", 0.0)
    td.set_non_tensor("tuple", [1, "three"])
    assert diff_expected(td, exp, lost=("f_nan", "f_inf", "tuple")) == [
        "<root>['f_nan']: value 0.0 != expected nan",
        "<root>['tuple']: python type builtins.list != expected builtins.tuple"
        " (value [1, 'three'])",
    ]


def test_lost_covers_g1_tensorclass(tmp_path: Path) -> None:
    """0.2.1 stores neither the tensorclass nor its non-tensor fields (same-version reload)."""
    exp = _expected("0.2.1", "tensorclass")
    td = TensorDict(
        {k: torch.tensor(exp["entries"][k]["values"]) for k in ("obs", "reward")}, batch_size=[3]
    )
    assert diff_expected(td, exp) == [
        "<root>: type 'TensorDict' != expected 'tensorclass:fixture_types.FixtureTC'",
        "<root>: missing key 'label' (expected non-tensor builtins.str 'episode-1')",
        "<root>: missing key 'extra' (expected non-tensor builtins.dict {'k': 1})",
    ]
    assert_matches_expected(td, exp, lost=[(), "label", "extra"])


def test_lost_paths_are_checked() -> None:
    exp = _expected(CURRENT, "tensorclass_in_td")
    with pytest.raises(
        ValueError, match=r"lost= names <root>\['nope'\], which is not in the expected record"
    ):
        diff_expected({}, exp, lost=["nope"])
    with pytest.raises(ValueError, match=r"<root>\['x'\], a tensor record: no writer destroys it"):
        diff_expected({}, exp, lost=["x"])
    with pytest.raises(TypeError, match="collection of paths"):
        diff_expected({}, exp, lost="x")
    assert diff_expected(
        {"tc": {}, "x": torch.tensor([7, 8, 9])}, exp, lost=[("tc", "label"), ("tc", "extra")]
    ) == [
        "<root>['tc']: missing key 'obs' (expected tensor torch.float32[3, 2])",
        "<root>['tc']: missing key 'reward' (expected tensor torch.float32[3])",
    ]


def test_unknown_record_shape_is_an_error() -> None:
    with pytest.raises(ValueError, match="unsupported expected record"):
        diff_expected(
            {"a": 1},
            {"type": "TensorDict", "batch_size": [], "entries": {"a": {"kind": "mystery"}}},
        )


# ----------------------------------------------------------------------------- conftest helpers


def test_copy_case_copies_everything_and_leaves_the_corpus_alone(tmp_path: Path) -> None:
    name = "odd_nested__robust_false"  # its writer put meta.json and v.memmap next to the prefix
    original = tree_digest(FIXTURES / CURRENT / name)
    target = copy_case(tmp_path, CURRENT, name)
    assert target == tmp_path / CURRENT / name / "ckpt"
    assert tree_digest(target.parent) == original
    assert {"meta.json", "v.memmap"} <= set(original)
    (target / "meta.json").write_text("{}")  # copies are writable ...
    assert tree_digest(FIXTURES / CURRENT / name) == original  # ... and independent
    archive = copy_case(
        tmp_path / "a",
        fixture_cases(versions=[CURRENT], where=lambda fc: fc.name == "archive_stored")[0],
    )
    assert archive.name == "ckpt.tdz" and set(tree_digest(archive)) == {"."}


def test_fixture_cases_ids_and_filters() -> None:
    cases = fixture_cases(versions=["0.13.0"])
    assert "0.13.0-odd_keys__default" in [fc.id for fc in cases]
    assert all(fc.case["status"] == "written" for fc in cases)
    version, name, case, target = cases[0]
    assert (version, target) == ("0.13.0", FIXTURES / "0.13.0" / name / case["target"])
    assert {fc.version for fc in fixture_cases()} == set(VERSIONS)
    with pytest.raises(ValueError, match="no fixtures for tensordict"):
        fixture_cases(versions=["9.9.9"])


def test_fixture_types_in_a_subprocess(fixture_types_env: dict[str, str]) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import fixture_types; print(fixture_types.Point(1, 2))"],
        env=fixture_types_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd="/",
    )
    assert out.stdout.strip() == "Point(x=1, y=2)"


def test_tiny_td() -> None:
    from conftest import tiny_td

    td = tiny_td(non_tensor=True)
    assert td.batch_size == torch.Size([3]) and td.device == torch.device("cpu")
    assert set(td.keys(include_nested=True, leaves_only=True)) == {"a", "b", ("nested", "c")}
    assert td["s"] == "hello"
    assert (tiny_td()["a"] == tiny_td()["a"]).all()
