"""safetensors out and in: tdckpt's files against the reference implementation, hostile files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import copy_case, tree_digest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tensordict import NonTensorData, TensorDict

import tdckpt
from tdckpt import cli
from tdckpt._interop.safetensors import DTYPES, INDEX_NAME, MAX_HEADER_BYTES
from tdckpt.errors import CheckpointExistsError, MetadataError, UnsupportedContentError


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    if dtype == torch.bool:  # a bool byte is 0 or 1
        return torch.randint(0, 2, shape, dtype=torch.bool)
    raw = torch.randint(
        0, 256, (int(torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8
    )
    return raw.view(dtype).reshape(shape)


ALL = sorted(DTYPES.items())


@pytest.mark.parametrize(("name", "dtype"), ALL)
def test_every_dtype_round_trips_bit_exactly_through_the_reference(
    tmp_path: Path, name: str, dtype: torch.dtype
) -> None:
    x = _sample(dtype)
    report = tdckpt.export_safetensors(
        {"x": x, "scalar": x[0, 0].clone()}, tmp_path / "a.safetensors"
    )
    header = _header(report.files[0])
    assert header["x"]["dtype"] == name
    ref = load_file(report.files[0])  # the reference reads what tdckpt wrote ...
    assert ref["x"].dtype == dtype and torch.equal(ref["x"].view(torch.uint8), x.view(torch.uint8))
    save_file({"x": x}, tmp_path / "ref.safetensors")  # ... and tdckpt what it writes
    back = tdckpt.load_safetensors(tmp_path / "ref.safetensors")
    assert back["x"].dtype == dtype
    assert torch.equal(back["x"].view(torch.uint8), x.view(torch.uint8))
    again = tdckpt.load_safetensors(report.files[0])
    assert torch.equal(
        again["scalar"].reshape(1).view(torch.uint8), x[0, 0].reshape(1).view(torch.uint8)
    )


def _header(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0  # the data starts aligned
    return json.loads(data[8 : 8 + n])


def test_a_checkpoint_of_any_release_exports(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.3.2", "nested")
    before = tree_digest(prefix)
    report = tdckpt.export_safetensors(prefix, tmp_path / "out")
    assert report.files == [tmp_path / "out" / "model.safetensors"] and report.index is None
    expected = tdckpt.load_memmap(prefix)
    ref = load_file(report.files[0])
    keys = [(k,) if isinstance(k, str) else k for k in expected.keys(True, True)]
    assert sorted(ref) == sorted(".".join(k) for k in keys)
    for key in keys:
        assert torch.equal(ref[".".join(key)], expected[key])
    assert tree_digest(prefix) == before


def test_tied_tensors_are_written_once_and_come_back_as_one(tmp_path: Path) -> None:
    w = torch.randn(4, 4)
    state = {"enc": {"w": w}, "dec": {"w": w}, "view": w[1:], "other": w.clone()}
    report = tdckpt.export_safetensors(state, tmp_path / "t.safetensors")
    assert report.tied == {"dec.w": "enc.w"}
    assert report.total_bytes == (16 + 12 + 16) * 4  # w once, the view and the copy apart
    assert sorted(load_file(report.files[0])) == ["enc.w", "other", "view"]
    back = tdckpt.load_safetensors(report.files[0])
    assert back["dec", "w"] is back["enc", "w"]
    assert torch.equal(back["dec", "w"], w) and torch.equal(back["view"], w[1:])


def test_shards_and_the_index_transformers_reads(tmp_path: Path) -> None:
    state = {f"layer{i}": {"w": torch.full((10,), float(i))} for i in range(5)}
    report = tdckpt.export_safetensors(state, tmp_path / "hf", max_shard_bytes=100)
    names = [p.name for p in report.files]
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 5 * 40
    assert set(index["weight_map"]) == {f"layer{i}.w" for i in range(5)}
    for name, file in index["weight_map"].items():  # every name is in the file it names
        assert name in load_file(tmp_path / "hf" / file)
    back = tdckpt.load_safetensors(tmp_path / "hf")
    assert all(torch.equal(back[f"layer{i}", "w"], state[f"layer{i}"]["w"]) for i in range(5))


def test_a_hugging_face_folder_written_by_the_reference_imports(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    a = {"model.embed.weight": torch.randn(5, 3), "model.norm.weight": torch.ones(3)}
    b = {"lm_head.weight": torch.randn(7, 3)}
    save_file(a, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(b, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in a}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in b}
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    back = tdckpt.load_safetensors(folder)
    assert torch.equal(back["model", "embed", "weight"], a["model.embed.weight"])
    assert torch.equal(back["lm_head", "weight"], b["lm_head.weight"])
    flat = tdckpt.load_safetensors(folder, nested=False)
    assert sorted(flat.keys()) == sorted(weight_map)


def test_loaded_tensors_are_private_views_of_one_mapping(tmp_path: Path) -> None:
    save_file(
        {"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.float64)}, tmp_path / "f.safetensors"
    )
    before = tree_digest(tmp_path)
    back = tdckpt.load_safetensors(tmp_path / "f.safetensors")
    back["a"] += 1  # copy-on-write: the file never changes
    back["b"] += 1
    assert tree_digest(tmp_path) == before
    base = back["a"].untyped_storage().data_ptr()
    assert back["b"].untyped_storage().data_ptr() == base  # the same mapping


def test_what_safetensors_cannot_hold_is_refused_or_skipped(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedContentError, match=r"'a\.b' is also the name"):
        tdckpt.export_safetensors(
            {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}, tmp_path / "x.safetensors"
        )
    with pytest.raises(UnsupportedContentError, match=r"a key part is empty"):
        tdckpt.export_safetensors({"": torch.zeros(1)}, tmp_path / "x.safetensors")
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    with pytest.raises(UnsupportedContentError, match="dense tensors only"):
        tdckpt.export_safetensors({"n": nested}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    td = TensorDict(w=torch.zeros(2), note=NonTensorData("hi"))
    report = tdckpt.export_safetensors(td, tmp_path / "x.safetensors")
    assert report.skipped == ["note"] and report.tensors == ["w"]
    with pytest.raises(CheckpointExistsError, match="already exists"):
        tdckpt.export_safetensors(td, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="pass a folder"):
        tdckpt.export_safetensors(td, tmp_path / "y.safetensors", max_shard_bytes=10)


# -- hostile files -----------------------------------------------------------------------------


def _file(tmp_path: Path, header: Any, data: bytes, *, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "data", "length", "match"),
    [
        ({"a": F32}, b"\0" * 4, None, "not a range inside the 4 data bytes"),
        ({"a": F32, "b": F32}, b"\0" * 8, None, "overlaps"),
        ({"a": F32, "b": {**F32, "data_offsets": [12, 20]}}, b"\0" * 20, None, "gap"),
        ({"a": F32}, b"\0" * 12, None, "4 bytes after the last tensor"),
        ({"a": {**F32, "shape": [3]}}, b"\0" * 8, None, "is 12 bytes, its range 8"),
        ({"a": {**F32, "dtype": "F128"}}, b"\0" * 8, None, "unknown dtype"),
        ({"a": {**F32, "shape": [-1]}}, b"\0" * 8, None, "sizes >= 0"),
        ({"a": {**F32, "shape": [2**40, 2**40]}}, b"\0" * 8, None, "its range 8"),
        ({"a": {**F32, "data_offsets": [0, "8"]}}, b"\0" * 8, None, "not a range"),
        ({"a": {**F32, "extra": 1}}, b"\0" * 8, None, "exactly dtype, shape and data_offsets"),
        ({"__metadata__": {"k": 1}, "a": F32}, b"\0" * 8, None, "strings to strings"),
        (b"{not json", b"", None, "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, b"", None, "not JSON \\(nested too deeply\\)"),
        (
            {"a": {**F32, "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}},
            b"",
            None,
            "2\\*\\*63",
        ),
        (
            {
                "a": {
                    **F32,
                    "dtype": "U8",
                    "shape": [0, 2**62, 2**62, 2**62],
                    "data_offsets": [0, 0],
                }
            },
            b"",
            None,
            "past 2\\*\\*63",
        ),
        (b"[]", b"", None, "not a JSON object"),
        ({"a": F32}, b"\0" * 8, 2**62, "claims"),
        ({"a": F32}, b"\0" * 8, MAX_HEADER_BYTES + 1, "claims"),
        (
            {"__metadata__": {"tdckpt.tied": '{"b": "zzz"}'}, "a": F32},
            b"\0" * 8,
            None,
            "tdckpt.tied",
        ),
    ],
)
def test_hostile_headers_are_refused_naming_the_file(
    tmp_path: Path, header: Any, data: bytes, length: int | None, match: str
) -> None:
    path = _file(tmp_path, header, data, length=length)
    with pytest.raises(MetadataError, match=match) as exc:
        tdckpt.load_safetensors(path)
    assert str(path) in str(exc.value) and exc.value.path == str(path)


def test_a_hostile_index_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a": torch.zeros(2)}, folder / "model-00001-of-00001.safetensors")
    for weight_map, match in [
        ({"a": "../outside.safetensors"}, "leaves the folder"),
        ({"a": "missing.safetensors"}, "not there"),
        (
            {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"},
            "does not hold it",
        ),
        ([1, 2], "weight_map"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ]:
        text = (
            json.dumps({"weight_map": weight_map})
            if not isinstance(weight_map, str)
            else ('{"weight_map": ' + weight_map + "}")
        )
        (folder / INDEX_NAME).write_text(text)
        with pytest.raises(MetadataError, match=match):
            tdckpt.load_safetensors(folder)


def test_a_tied_name_never_replaces_a_tensor_of_another_shard(tmp_path: Path) -> None:
    """Shard 2 records ``a`` as tied to its ``b`` while shard 1 holds a real ``a``: two
    tensors under one name, refused (as two real tensors are). Before, the alias silently
    replaced shard 1's ``a``."""
    folder = tmp_path / "hf"
    folder.mkdir()
    one, two = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"a": torch.ones(1), "c": torch.full((1,), 3.0)}, folder / one)
    save_file({"b": torch.full((1,), 2.0)}, folder / two, metadata={"tdckpt.tied": '{"a": "b"}'})
    (folder / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": two, "b": two, "c": one}}))
    with pytest.raises(MetadataError, match=r"the tied name 'a' is also a tensor of another file"):
        tdckpt.load_safetensors(folder)


def test_keys_that_differ_only_in_type_are_refused_not_merged(tmp_path: Path) -> None:
    """``{1: x, "1": y}`` both become the name ``"1"``: refused, naming the key. Before, one
    tensor was silently dropped (the report listed one name and nothing skipped)."""
    for source in (
        {1: torch.ones(2), "1": torch.zeros(2)},
        {"m": {True: torch.ones(1), "True": torch.ones(1)}},
    ):
        with pytest.raises(UnsupportedContentError, match=r"is also the name of another key"):
            tdckpt.export_safetensors(source, tmp_path / "x.safetensors")
        assert not (tmp_path / "x.safetensors").exists()


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_files_load_as_the_reference_does_or_are_refused(tmp_path: Path, data: Any) -> None:
    # A valid file with bytes of its header or length mutated: tdckpt either loads what the
    # reference loads, or refuses it with a MetadataError (never another exception).
    save_file(
        {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.int16)},
        tmp_path / "ok.safetensors",
    )
    raw = bytearray((tmp_path / "ok.safetensors").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, min(len(raw) - 1, 120)))
        raw[pos] = data.draw(st.integers(0, 255))
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(bytes(raw))
    try:
        ours = tdckpt.load_safetensors(path, nested=False)
    except MetadataError:
        return
    ref = load_file(path)  # what tdckpt accepted, the reference reads the same way
    assert sorted(ours.keys()) == sorted(ref)
    for name in ref:
        assert torch.equal(ours[name].view(torch.uint8), ref[name].view(torch.uint8))


# -- the commands ------------------------------------------------------------------------------


def test_cli_export_import_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with tdckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(5, TensorDict(w=torch.randn(3, 3), b=torch.zeros(3), note=NonTensorData("x")))
    code, out, err = run(
        capsys,
        "export",
        "5",
        str(tmp_path / "hf"),
        "--root",
        str(tmp_path / "run"),
        "--max-shard-size",
        "40B",
    )
    assert code == 0 and err == ""
    assert "wrote " + str(tmp_path / "hf" / INDEX_NAME) in out
    assert "skipped note (not a tensor" in out
    code, out, _ = run(capsys, "import", str(tmp_path / "hf"), str(tmp_path / "back"), "--json")
    assert code == 0 and json.loads(out) == {"prefix": str(tmp_path / "back"), "leaves": 2}
    report = tdckpt.diff(tmp_path / "run" / "5", tmp_path / "back")
    assert [(e.key, e.change) for e in report.entries] == [(("note",), "removed")]
    # One file into the folder of the shards: refused (the index names the shards) ...
    code, _, err = run(capsys, "export", str(tmp_path / "run" / "5"), str(tmp_path / "hf"))
    assert code == 1 and "model-00001-of-00002.safetensors: already exists" in err
    # ... or replaces the whole earlier export.
    code, _, _ = run(
        capsys, "export", str(tmp_path / "run" / "5"), str(tmp_path / "hf"), "--overwrite"
    )
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    with pytest.raises(SystemExit):
        run(capsys, "export", "x", str(tmp_path / "o"), "--root", str(tmp_path / "run"))
    with pytest.raises(SystemExit):
        run(capsys, "export", "5", str(tmp_path / "o"), "--max-shard-size", "lots")


def test_an_export_to_a_missing_folder_or_over_a_folder_names_the_output(tmp_path: Path) -> None:
    """Both were raw OSErrors naming the hidden temporary file beside the output."""
    from tdckpt.errors import UnsafePathError

    with pytest.raises(
        UnsafePathError, match=r"missing/x\.safetensors: its folder .* does not exist"
    ):
        tdckpt.export_safetensors({"a": torch.ones(1)}, tmp_path / "missing" / "x.safetensors")
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(CheckpointExistsError, match=r"d\.safetensors: is a folder"):
        tdckpt.export_safetensors({"a": torch.ones(1)}, tmp_path / "d.safetensors", overwrite=True)
    (tmp_path / "notes").write_text("mine")  # a file where the export's folder belongs
    with pytest.raises(CheckpointExistsError, match=r"notes: is a file, not a folder"):
        tdckpt.export_safetensors({"a": torch.ones(1)}, tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors", "notes"]
    assert not any((tmp_path / "d.safetensors").iterdir())


def test_a_module_state_dict_exports_under_its_own_dotted_names(tmp_path: Path) -> None:
    """A state_dict's keys hold dots ("0.weight"): exported as they are, the names Hugging
    Face uses (the export refused every module's state_dict before); read back flat they
    are the same names."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    report = tdckpt.export_safetensors(model.state_dict(), tmp_path / "m.safetensors")
    assert sorted(report.tensors) == sorted(model.state_dict())
    ref = load_file(tmp_path / "m.safetensors")
    back = tdckpt.load_safetensors(tmp_path / "m.safetensors", nested=False)
    for name, tensor in model.state_dict().items():
        assert torch.equal(ref[name], tensor) and torch.equal(back[name], tensor)
