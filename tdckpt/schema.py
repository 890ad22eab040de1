"""Versioned metadata schemas: the tensordict on-disk format and tdckpt's manifest.

Two documents are described here, each a frozen pydantic model:

* the ``meta.json`` of each level of a checkpoint in the **current tensordict format**
  (``"_format_version": 1``, written by tensordict 0.15.3 - generation G8 in
  format-notes.md). Older generations are migrated to this form before validation
  (``migrations/``), so only the current form is modelled.
* tdckpt's own per-checkpoint **manifest** (``tdckpt.manifest.json`` at the root of a
  prefix), which records what no tensordict file does: the key encoding, the pickle
  inventory, the writer versions, the size and checksum of every file, the user's metadata.
* the **step manifest of a sharded step** (:class:`ShardedManifest`, the same file name at
  the root of a step saved by several ranks): a manifest whose files span every rank's
  shard prefix, plus the rows of the global batch each shard holds and the attempt folder
  the step commits.

The JSON Schema of every model is exported to ``schemas/`` (``python -m tdckpt.schema``);
a test regenerates them and fails when they drift.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tdckpt._write.checksum import DIGEST_HEX_LENGTHS
from tdckpt.errors import MetadataError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA_VERSION",
    "SCHEMA_MODELS",
    "SHARDED_SCHEMA_VERSION",
    "STATE_KINDS",
    "ChildEntry",
    "ConsolidatedRecord",
    "FileRecord",
    "LazyStackMeta",
    "LeafChecksumRecord",
    "LeafEntry",
    "Manifest",
    "NonTensorDataMeta",
    "NonTensorStackMeta",
    "PickleRecord",
    "ReplicatedRecord",
    "ShardRecord",
    "ShardedManifest",
    "StateEntryRecord",
    "StateRecord",
    "TensorClassMeta",
    "TensorDictMeta",
    "WriterVersions",
    "export_schemas",
]

#: The tensordict format version this tdckpt reads and writes (tensordict 0.15.3).
FORMAT_VERSION = 1
#: The version of tdckpt's manifest schema.
MANIFEST_SCHEMA_VERSION = 1
#: The manifest's file name at the root of a prefix (tensordict ignores unlisted files).
MANIFEST_NAME = "tdckpt.manifest.json"
#: The most bytes a manifest (or an object-storage commit record) may have: readers refuse a
#: larger one unread, so writers refuse to write one (:func:`manifest_bytes`).
MAX_MANIFEST_BYTES = 256 * 1024 * 1024


def manifest_bytes(doc: Any, where: str, *, indent: int | None = 1) -> bytes:
    """``doc`` as the JSON text of a manifest (or commit record) - refused when larger than a
    reader accepts (:data:`MAX_MANIFEST_BYTES`), so that no step is committed that no reader
    could list.

    Raises:
        MetadataError: naming ``where`` and the size, before anything is committed.
    """
    data = (json.dumps(doc, indent=indent, allow_nan=False) + "\n").encode("utf-8")
    if len(data) > MAX_MANIFEST_BYTES:
        raise MetadataError(
            f"{where}: the step's manifest would be {len(data)} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} a reader accepts, so nothing was committed (a step already "
            "saved there is kept). Its metadata is most of it when it holds large values: "
            "save those as tensors of the step instead.",
            path=where,
        )
    return data


#: Upper bound for one dimension: shapes are int64 in torch.
_MAX_DIM = 2**62
Dim = Annotated[int, Field(ge=0, le=_MAX_DIM)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


# -- tensordict meta.json, format v1 ---------------------------------------------------------


class LeafEntry(_Model):
    """A dense or strided-nested tensor leaf: ``<key>.memmap`` (+ ``<key>.shape.memmap``)."""

    device: str | None = None
    shape: list[Dim] = Field(max_length=64)
    dtype: str
    is_nested: bool = False


class ChildEntry(_Model):
    """A nested collection, stored in the sub-directory named after its key."""

    type: str


Entry = LeafEntry | ChildEntry


def _split_entries(raw: Any) -> Any:
    """Move every dict-valued item into ``entries``: those are the level's keys.

    tensordict mixes the keys of a level with its format fields in one JSON object. Every
    dict value is a key's entry (a key named ``_names`` or ``_format_version`` keeps its
    dict entry, and the file then reads as version 0, as tensordict does).
    """
    if not isinstance(raw, dict):
        return raw
    out: dict[str, Any] = {}
    entries: dict[str, Any] = {}
    for name, value in raw.items():
        if isinstance(value, dict):
            entries[name] = value
        else:
            out[name] = value
    out["entries"] = entries
    # A key named like a format field keeps its entry and tensordict then writes no such
    # field: the level "reads as version 0" there, and its content is still the current
    # layout. Fill the field in, so the key does not make the level invalid.
    if "_format_version" in entries and "_format_version" not in out:
        out["_format_version"] = FORMAT_VERSION
    if "_class" in entries and "_class" not in out:
        type_str = str(out.get("_type", ""))
        module, _, name = type_str.removeprefix("<class '").removesuffix("'>").rpartition(".")
        out["_class"] = f"{module}:{name}"
    return out


class TensorDictMeta(_Model):
    """``meta.json`` of a TensorDict level (also the ``_tensordict/`` of a tensorclass)."""

    shape: list[Dim] = Field(max_length=64, description="the batch size")
    device: str | None = None
    type_: str = Field(alias="_type")
    format_version: Literal[1] = Field(alias="_format_version")
    class_: str = Field(alias="_class")
    names: list[str | None] | None = Field(default=None, alias="_names")
    entries: dict[str, Entry] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _split(cls, raw: Any) -> Any:
        return _split_entries(raw)

    @field_validator("device", mode="before")
    @classmethod
    def _none_device(cls, value: Any) -> Any:
        return None if value == "None" else value


class LazyStackMeta(_Model):
    """``meta.json`` of a LazyStackedTensorDict; members live in ``0/``, ``1/``, ..."""

    type_: str = Field(alias="_type")
    format_version: Literal[1] = Field(alias="_format_version")
    class_: str = Field(alias="_class")
    stack_dim: int = Field(ge=0, le=64)
    stack_dim_name: str | None = None


class NonTensorDataMeta(_Model):
    """``meta.json`` of a NonTensorData / MetaData value (no format version at this level).

    ``data`` is absent when the value was pickled into ``other.pickle``.
    """

    model_config = ConfigDict(frozen=True, extra="allow", populate_by_name=True)

    type_: str = Field(alias="_type")
    data: Any = None
    metadata: Any = Field(default=None, alias="_metadata")
    is_non_tensor: bool = Field(default=True, alias="_is_non_tensor")


class NonTensorStackMeta(_Model):
    """``meta.json`` of a NonTensorStack: the nested list inline, or ``"pickle.pkl"``."""

    type_: str = Field(alias="_type")
    format_version: Literal[1] = Field(alias="_format_version")
    class_: str = Field(alias="_class")
    stack_dim: int = Field(ge=0, le=64)
    stack_dim_name: str | None = None
    device: str | None = None
    data: list[Any] | Literal["pickle.pkl"]


class TensorClassMeta(_Model):
    """``meta.json`` of a tensorclass: ``_type`` plus JSON-able non-tensor fields.

    Tensor fields live in ``_tensordict/``; pickled fields in ``other.pickle``.
    """

    model_config = ConfigDict(frozen=True, extra="allow", populate_by_name=True)

    type_: str = Field(alias="_type")


# -- tdckpt manifest ----------------------------------------------------------------------


#: A checksum: one of the algorithms ``verify`` computes, then exactly as many hex digits as
#: its digest has (a digest of another length can never match: a damaged manifest, not a
#: changed file).
_CHECKSUM_PATTERN = (
    "^(?:" + "|".join(f"{a}:[0-9a-f]{{{n}}}" for a, n in sorted(DIGEST_HEX_LENGTHS.items())) + ")$"
)
#: One path component other than "", "." and ".." (no "/" or NUL): it starts with a
#: character other than "."; or is "." and more, the second character not "."; or ".."
#: and more.
_COMPONENT = r"(?:[^/\x00.][^/\x00]*|\.[^/\x00.][^/\x00]*|\.\.[^/\x00]+)"
#: A relative POSIX path inside the checkpoint: one or more such components. ``verify`` and
#: ``upgrade`` look files up by it, so it must name a file inside the prefix.
_FILE_PATH = f"^{_COMPONENT}(?:/{_COMPONENT})*$"


class FileRecord(_Model):
    """One file of the checkpoint, as written.

    Both strings are checked by pattern, in pydantic's core (a 10,000-leaf manifest is
    validated on every read of its step; a Python validator per record cost as much as the
    rest of the validation).
    """

    path: str = Field(
        description="POSIX path relative to the prefix: no '..', '.' or empty component, no "
        "leading '/', no NUL",
        pattern=_FILE_PATH,
    )
    size: int = Field(ge=0)
    checksum: str | None = Field(
        default=None,
        description="'<algorithm>:<hex digest>' with an algorithm tdckpt computes (crc32 or a "
        "fixed-length hashlib algorithm) and its digest's number of hex digits; None when not "
        "computed",
        pattern=_CHECKSUM_PATTERN,
    )
    key: list[str] | None = Field(default=None, description="the nested key it stores, if a leaf")


#: What the patterns above mean, for messages (pydantic's own quotes the pattern).
_PATTERN_MEANINGS = {
    _FILE_PATH: "is not a relative POSIX path inside the checkpoint (no '..', '.' or empty "
    "component, no leading '/', no NUL)",
    _CHECKSUM_PATTERN: "is not '<algorithm>:<hex digest>' with an algorithm tdckpt computes "
    "and as many hex digits as its digest has",
}


def explain(exc: ValidationError, *, limit: int = 5) -> str:
    """A pydantic ValidationError of a tdckpt document as one line: each error's location
    and what is wrong (a pattern said in words), at most ``limit`` of them."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(part) for part in err["loc"]) or "<document>"
        meaning = _PATTERN_MEANINGS.get((err.get("ctx") or {}).get("pattern", ""))
        if err["type"] == "string_pattern_mismatch" and meaning is not None:
            parts.append(f"{where}: {err['input']!r} {meaning}")
        else:
            parts.append(f"{where}: {err['msg']}")
    more = f"; and {len(parts) - limit} more" if len(parts) > limit else ""
    return "; ".join(parts[:limit]) + more


class PickleRecord(_Model):
    """A non-tensor value stored as a pickle."""

    key: list[str]
    file: str
    kind: Literal["other.pickle", "pickle.pkl"]


#: What an entry of a saved training state was (see :mod:`tdckpt._state`).
STATE_KINDS = ("tensordict", "module", "optimizer", "scheduler", "rng", "stateful")


class StateEntryRecord(_Model):
    """One entry of a saved training state: what it was, so a restore can check its target."""

    kind: Literal["tensordict", "module", "optimizer", "scheduler", "rng", "stateful"]
    type: str = Field(description="the saved object's class, 'module:qualname'")


class StateRecord(_Model):
    """A step saved from a training state (a mapping of names to live objects)."""

    entries: dict[str, StateEntryRecord] = Field(
        description="entry name -> what it was, in the order they were given"
    )


class LeafChecksumRecord(_Model):
    """One leaf of a consolidated data file: where its bytes are and their checksum."""

    key: list[str] = Field(description="the nested key of the leaf")
    offset: int = Field(ge=0, description="byte offset of the leaf in the data file")
    size: int = Field(ge=0, description="bytes of the leaf (without padding)")
    checksum: str | None = Field(default=None, pattern=_CHECKSUM_PATTERN)


class ConsolidatedRecord(_Model):
    """A step saved in tensordict's consolidated layout: one data file holds every leaf."""

    file: str = Field(
        pattern=_FILE_PATH,
        description="the data file (what TensorDict.from_consolidated reads), relative path",
    )
    leaves: list[LeafChecksumRecord] = Field(default_factory=list)


class WriterVersions(_Model):
    """Versions of the software that wrote the checkpoint."""

    tdckpt: str
    tensordict: str | None = None
    torch: str
    python: str


class Manifest(_Model):
    """``tdckpt.manifest.json``: what tdckpt wrote or established about a prefix."""

    schema_version: int = Field(ge=1, description="version of this manifest schema")
    format_version: int = Field(ge=0, description="tensordict format version of the data")
    created: str = Field(description="UTC ISO-8601 time of writing")
    writer: WriterVersions
    key_encoding: Literal["robust", "legacy"]
    step: int | None = None
    root_type: str = Field(description="the saved class, e.g. 'tensordict:TensorDict'")
    pickles: list[PickleRecord] = Field(default_factory=list)
    files: list[FileRecord] = Field(default_factory=list)
    user_metadata: dict[str, Any] = Field(default_factory=dict)
    migrated_from: str | None = Field(
        default=None, description="the generation the checkpoint had before an upgrade"
    )
    migrations: list[str] = Field(default_factory=list, description="upgrade steps applied")
    state: StateRecord | None = Field(
        default=None,
        description="present when the step was saved from a training state: one record per "
        "entry (each a sub-TensorDict of the step)",
    )
    consolidated: ConsolidatedRecord | None = Field(
        default=None,
        description="present when the step is one consolidated data file "
        "(layout='consolidated'): the file and every leaf's offset, size and checksum",
    )

    @field_validator("files")
    @classmethod
    def _unique_paths(cls, value: list[FileRecord]) -> list[FileRecord]:
        # Two records of one file would let the second hide what the first says.
        seen: set[str] = set()
        for record in value:
            if record.path in seen:
                raise ValueError(f"the file {record.path!r} is listed twice")
            seen.add(record.path)
        return value


#: The version of the sharded step manifest's own fields (shards, rows, attempt).
SHARDED_SCHEMA_VERSION = 1
#: A relative POSIX path of one or more plain components (no '..', '.', '' or NUL).
_REL_PATH = r"^[^/\x00]+(/[^/\x00]+)*$"


def _check_rel(value: str) -> str:
    if any(part in (".", "..") for part in value.split("/")):
        raise ValueError(f"{value!r} is not a relative path inside the step (no '.' or '..')")
    return value


class ShardRecord(_Model):
    """One rank's shard of a sharded step: a plain tensordict prefix holding some rows."""

    rank: int = Field(ge=0, description="the rank that wrote it (shards are in rank order)")
    prefix: str = Field(
        pattern=_REL_PATH, description="the shard's folder, relative to the step folder"
    )
    start: Dim = Field(description="first global row (along dim 0) the shard holds")
    stop: Dim = Field(description="one past the last global row the shard holds")
    root_type: str = Field(description="the class saved in the shard")

    @field_validator("prefix")
    @classmethod
    def _inside(cls, value: str) -> str:
        return _check_rel(value)


class ReplicatedRecord(_Model):
    """The entries saved once (by rank 0) rather than split across the shards."""

    prefix: str = Field(pattern=_REL_PATH, description="its folder, relative to the step folder")
    keys: list[list[str]] = Field(description="the nested keys it holds")

    @field_validator("prefix")
    @classmethod
    def _inside(cls, value: str) -> str:
        return _check_rel(value)


class ShardedManifest(Manifest):
    """The step manifest of a step saved by several ranks (``tdckpt.manifest.json``).

    ``files`` lists every file of every shard (paths relative to the step folder);
    ``shards`` says which global rows each shard holds. The shards cover the global rows
    ``0 .. batch_size[0]`` once each, in rank order.
    """

    sharded: Literal[1] = Field(description="the version of the sharded step fields")
    world_size: int = Field(ge=1, description="ranks that saved the step")
    attempt: str = Field(
        pattern=r"^attempt-[0-9a-f]{32}$", description="the attempt folder this step commits"
    )
    batch_size: list[Dim] = Field(min_length=1, max_length=64, description="the global batch size")
    shards: list[ShardRecord] = Field(min_length=1)
    replicated: ReplicatedRecord | None = None
    layout: Literal["memmap", "consolidated"] = Field(
        default="memmap",
        description="how each shard is saved: 'memmap' (a tensordict folder, a file per leaf) "
        "or 'consolidated' (one data file, tensordict.consolidated, with the shard's own "
        "manifest of per-leaf checksums). Written only when 'consolidated'",
    )
    manifest_checksum: str | None = Field(
        default=None,
        description="'<algorithm>:<hex digest>' of this document without this field, as "
        "canonical JSON (keys sorted, no spaces, ASCII); checked by every read of the step. "
        "None in sharded steps written before it was recorded",
        pattern=_CHECKSUM_PATTERN,
    )

    @model_validator(mode="after")
    def _coverage(self) -> ShardedManifest:
        if len(self.shards) != self.world_size:
            raise ValueError(f"{len(self.shards)} shards for a world size of {self.world_size}")
        row = 0
        for i, shard in enumerate(self.shards):
            if shard.rank != i:
                raise ValueError(f"shard {i} is recorded as rank {shard.rank}")
            if shard.start != row or shard.stop < shard.start:
                raise ValueError(
                    f"shard {i} holds rows {shard.start}..{shard.stop}; expected it to start "
                    f"at row {row} (shards cover the global rows once, in rank order)"
                )
            row = shard.stop
        if row != self.batch_size[0]:
            raise ValueError(
                f"the shards cover {row} rows of a global batch of {self.batch_size[0]}"
            )
        prefixes = [s.prefix for s in self.shards]
        if self.replicated is not None:
            prefixes.append(self.replicated.prefix)
        for prefix in prefixes:
            if prefix.split("/")[0] != self.attempt:
                raise ValueError(f"the prefix {prefix!r} lies outside the attempt {self.attempt!r}")
        if len(set(prefixes)) != len(prefixes):
            raise ValueError("two shards share a prefix")
        return self


#: name -> model of every exported JSON Schema (``schemas/<name>.v<N>.json``).
SCHEMA_MODELS: dict[str, tuple[type[BaseModel], int]] = {
    "tensordict-meta": (TensorDictMeta, FORMAT_VERSION),
    "lazystack-meta": (LazyStackMeta, FORMAT_VERSION),
    "nontensordata-meta": (NonTensorDataMeta, FORMAT_VERSION),
    "nontensorstack-meta": (NonTensorStackMeta, FORMAT_VERSION),
    "tensorclass-meta": (TensorClassMeta, FORMAT_VERSION),
    "manifest": (Manifest, MANIFEST_SCHEMA_VERSION),
    "sharded-manifest": (ShardedManifest, SHARDED_SCHEMA_VERSION),
}


def schema_documents() -> dict[str, str]:
    """File name -> JSON text of every schema, exactly as ``schemas/`` must hold them."""
    docs = {}
    for name, (model, version) in SCHEMA_MODELS.items():
        schema = model.model_json_schema(by_alias=True)
        schema["$id"] = f"https://tdckpt.invalid/schemas/{name}.v{version}.json"
        docs[f"{name}.v{version}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return docs


def export_schemas(directory: str | Path) -> list[Path]:
    """Write every JSON Schema into ``directory``; return the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, text in schema_documents().items():
        path = directory / fname
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":  # pragma: no cover - `python -m tdckpt.schema [DIR]`
    for p in export_schemas(sys.argv[1] if len(sys.argv) > 1 else "schemas"):
        print(p)
