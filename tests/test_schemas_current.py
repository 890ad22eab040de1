"""The exported JSON Schemas are current, and the current-format models accept real files.

``schemas/`` is generated (``python -m tdckpt.schema``) and never hand-edited: regenerating it
must give exactly the checked-in files. Every ``meta.json`` that tensordict 0.15.3 wrote into
the fixture corpus must validate against the model of its level.
"""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import pydantic
import pytest
from conftest import FIXTURES, TESTS_DIR

from tdckpt import schema

SCHEMAS_DIR = TESTS_DIR.parent / "schemas"
CURRENT = FIXTURES / "0.15.3"


def test_schema_files_are_current() -> None:
    docs = schema.schema_documents()
    on_disk = {p.name: p.read_text(encoding="utf-8") for p in SCHEMAS_DIR.glob("*.json")}
    assert sorted(on_disk) == sorted(docs), "schemas/ holds other files than the models export"
    stale = [name for name, text in docs.items() if on_disk[name] != text]
    assert not stale, f"regenerate with `python -m tdckpt.schema schemas`: {stale} drifted"


def test_export_schemas_writes_the_same_bytes(tmp_path: Path) -> None:
    written = schema.export_schemas(tmp_path / "out")
    assert {p.name for p in written} == {p.name for p in SCHEMAS_DIR.glob("*.json")}
    for path in written:
        assert path.read_bytes() == (SCHEMAS_DIR / path.name).read_bytes()


def test_schema_documents_are_json_schemas() -> None:
    for name, text in schema.schema_documents().items():
        doc = json.loads(text)
        assert doc["$id"].endswith(name)
        assert doc["type"] == "object"
        assert text.endswith("\n")


def _model_for(meta: dict[str, Any]) -> type[pydantic.BaseModel]:
    """The model of a level, read from its ``_class`` / ``_type`` as tensordict dispatches."""
    name = str(meta.get("_class") or meta.get("_type", "")).rstrip("'>")
    name = name.rpartition(":")[2].rpartition(".")[2]
    if name == "LazyStackedTensorDict":
        return schema.LazyStackMeta
    if name == "NonTensorStack":
        return schema.NonTensorStackMeta
    if name in ("NonTensorData", "MetaData"):
        return schema.NonTensorDataMeta
    if name == "TensorDict":
        return schema.TensorDictMeta
    return schema.TensorClassMeta


def _current_meta_files() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(CURRENT.rglob("meta.json")):
        out.append((path.relative_to(CURRENT).as_posix(), json.loads(path.read_bytes())))
    for archive in sorted(CURRENT.rglob("*.tdz")):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if name == "meta.json" or name.endswith("/meta.json"):
                    rel = f"{archive.relative_to(CURRENT).as_posix()}!{name}"
                    out.append((rel, json.loads(zf.read(name))))
    return out


META_FILES = _current_meta_files()


def test_the_corpus_covers_every_current_level_kind() -> None:
    kinds = Counter(_model_for(meta).__name__ for _, meta in META_FILES)
    assert kinds["TensorDictMeta"] >= 20
    assert kinds["LazyStackMeta"] >= 1
    assert kinds["NonTensorDataMeta"] >= 10
    assert kinds["TensorClassMeta"] >= 2
    assert any("!" in rel for rel, _ in META_FILES)  # archives are included


@pytest.mark.parametrize(("rel", "meta"), META_FILES, ids=[rel for rel, _ in META_FILES])
def test_current_meta_json_validates(rel: str, meta: dict[str, Any]) -> None:
    model = _model_for(meta)
    parsed = model.model_validate(meta)
    if isinstance(parsed, schema.TensorDictMeta):
        assert parsed.format_version == schema.FORMAT_VERSION
        assert parsed.class_ == meta["_class"]
        assert list(parsed.shape) == meta["shape"]
        # Every dict-valued item of the file is a key's entry, and nothing else is.
        keys = {k for k, v in meta.items() if isinstance(v, dict)}
        assert set(parsed.entries) == keys
        for key, entry in parsed.entries.items():
            raw = meta[key]
            if "dtype" in raw:
                assert isinstance(entry, schema.LeafEntry)
                assert entry.dtype == raw["dtype"] and list(entry.shape) == raw["shape"]
            else:
                assert isinstance(entry, schema.ChildEntry)
                assert entry.type == raw["type"]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"_format_version": 2}, "_format_version"),
        ({"shape": [-1]}, "shape"),
        ({"shape": [2**63]}, "shape"),
        ({"surprise": 1}, "surprise"),
        ({"x": {"dtype": "torch.float32"}}, "shape"),
    ],
)
def test_current_model_is_strict(edit: dict[str, Any], field: str) -> None:
    base = json.loads((CURRENT / "flat" / "ckpt" / "meta.json").read_bytes())
    with pytest.raises(pydantic.ValidationError, match=field):
        schema.TensorDictMeta.model_validate({**base, **edit})
