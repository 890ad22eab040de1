"""The layout of a checkpoint root in object storage, and the commit record.

::

    <root>/<step>.tdckpt.json              the commit record: the step exists iff this does
    <root>/<step>.attempt-<32 hex>/data-N  the step's bytes, one prefix per save attempt
    <root>/.tdckpt-lease/<generation>.json the writer lease (tdckpt._remote.lease)

A save uploads the step's files into a fresh attempt prefix (never one that exists), then
creates the commit record with a conditional create; retention deletes the record first
and the attempt after; gc deletes attempts that no record names once they are older than
a grace period. Nothing is ever renamed or overwritten.

The files of a step are those a local save writes (tensordict 0.15.3's format, listed with
sizes and checksums in the manifest, embedded in the record). Large files are objects of
their own; small ones are packed back to back into shared objects, so 1,000 small leaves
cost a handful of requests rather than 1,000. The record says where every file lies
(object, offset); the manifest says what its bytes must hash to.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tdckpt.errors import MetadataError
from tdckpt.schema import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, manifest_bytes

__all__ = [
    "COMMIT_SUFFIX",
    "LEASE_DIR",
    "CommitRecord",
    "attempt_name",
    "commit_name",
    "parse_attempt",
    "parse_commit",
    "parse_record",
    "record_version",
]

#: The newest commit record version this tdckpt reads; 2 adds objects that lie under another
#: step's attempt prefix (``ObjectRecord.prefix``: an incremental save). A record without
#: such objects is still written as version 1, readable by every tdckpt.
COMMIT_VERSION = 2
COMMIT_SUFFIX = ".tdckpt.json"
LEASE_DIR = ".tdckpt-lease"
#: Files up to this size are packed together; larger ones are objects of their own.
PACK_FILE_MAX = 1 << 20
#: A pack object is closed once it reaches this size.
PACK_TARGET = 16 << 20
#: Largest commit record read (it holds the manifest: ~200 bytes per file).
MAX_RECORD_BYTES = MAX_MANIFEST_BYTES

_COMMIT = re.compile(r"^(0|[1-9][0-9]{0,3999})" + re.escape(COMMIT_SUFFIX) + r"$")
_ATTEMPT = re.compile(r"^(0|[1-9][0-9]{0,3999})\.attempt-([0-9a-f]{32})$")
_OBJECT = re.compile(r"^data-(0|[1-9][0-9]{0,8})$")


def commit_name(step: int) -> str:
    return f"{step}{COMMIT_SUFFIX}"


def attempt_name(step: int, attempt: str) -> str:
    return f"{step}.attempt-{attempt}"


def parse_commit(name: str) -> int | None:
    m = _COMMIT.match(name)
    return int(m.group(1)) if m else None


def parse_attempt(name: str) -> tuple[int, str] | None:
    m = _ATTEMPT.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def record_version(objects: list[ObjectRecord]) -> int:
    """The commit record version for ``objects``: 2 when one lies under another attempt."""
    return 2 if any(o.prefix is not None for o in objects) else 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ObjectRecord(_Model):
    name: str = Field(description="data-N, under the attempt prefix")
    size: int = Field(ge=0)
    prefix: str | None = Field(
        default=None,
        pattern=r"^(0|[1-9][0-9]{0,3999})\.attempt-[0-9a-f]{32}$",
        description="the attempt prefix holding the object when an earlier step uploaded it "
        "(an incremental save refers to it instead of uploading it again); None: this "
        "record's own attempt",
    )


class Location(_Model):
    object: int = Field(ge=0, description="index into objects")
    offset: int = Field(ge=0)


class CommitRecord(_Model):
    """``<step>.tdckpt.json``: which attempt holds the step, where each file lies in it,
    and the step's manifest (what each file must be)."""

    commit_version: int = Field(ge=1)
    step: int = Field(ge=0)
    attempt: str = Field(pattern=r"^[0-9a-f]{32}$")
    writer: str = Field(description="the committing manager's id")
    objects: list[ObjectRecord]
    locations: dict[str, Location]
    manifest: Manifest

    @model_validator(mode="after")
    def _consistent(self) -> CommitRecord:
        names = [o.name for o in self.objects]
        bad = [n for n in names if not _OBJECT.match(n)]
        where = [(o.prefix, o.name) for o in self.objects]
        if bad or len(set(where)) != len(where):
            raise ValueError(f"object names must be distinct data-N names, got {names[:5]}")
        shared = [o.prefix for o in self.objects if o.prefix is not None]
        if shared and self.commit_version < 2:
            raise ValueError("objects under another attempt prefix need commit_version 2")
        if attempt_name(self.step, self.attempt) in shared:
            raise ValueError("an object names this record's own attempt as another prefix")
        files = {f.path: f for f in self.manifest.files}
        if MANIFEST_NAME in files:
            raise ValueError(f"the manifest lists {MANIFEST_NAME} itself among the step's files")
        folders = {path.rsplit("/", 1)[0] for path in files if "/" in path}
        folders |= {f.rsplit("/", i)[0] for f in list(folders) for i in range(1, f.count("/") + 1)}
        clash = sorted(folders & set(files))[:5]
        if clash:
            raise ValueError(f"{clash} are listed as files and as folders of other files")
        unchecked = sorted(path for path, f in files.items() if f.checksum is None)[:5]
        if unchecked:  # where a file lies is the record's word: only its checksum checks it
            raise ValueError(
                f"{unchecked} have no checksum (tdckpt records one for every file of a step in "
                "object storage)"
            )
        if set(files) != set(self.locations):
            missing = sorted(set(files) - set(self.locations))[:5]
            extra = sorted(set(self.locations) - set(files))[:5]
            raise ValueError(
                f"locations do not match the manifest (missing {missing}, extra {extra})"
            )
        for path, loc in self.locations.items():
            if loc.object >= len(self.objects):
                raise ValueError(f"{path!r} lies in object {loc.object}, which is not listed")
            if loc.offset + files[path].size > self.objects[loc.object].size:
                raise ValueError(f"{path!r} runs past the end of {self.objects[loc.object].name}")
        if self.manifest.step is not None and self.manifest.step != self.step:
            raise ValueError(f"the manifest is step {self.manifest.step}, the record {self.step}")
        return self

    def to_bytes(self, where: str) -> bytes:
        """The record's JSON text; MetadataError naming ``where`` (its URL) when larger than a
        reader accepts (:func:`tdckpt.schema.manifest_bytes`)."""
        raw = self.model_dump(mode="json")
        for obj in raw["objects"]:  # version 1 records carry no "prefix": readable by all
            if obj.get("prefix") is None:
                obj.pop("prefix", None)
        return manifest_bytes(raw, where, indent=None)

    def object_path(self, index: int) -> str:
        """Where object ``index`` lies, relative to the root: ``<attempt prefix>/data-N``."""
        obj = self.objects[index]
        return f"{obj.prefix or attempt_name(self.step, self.attempt)}/{obj.name}"


def parse_record(data: bytes, where: str, step: int) -> CommitRecord:
    """Parse and check a commit record; MetadataError naming what is wrong."""
    try:
        raw: Any = json.loads(data.decode("utf-8"))
        version: Any = raw.get("commit_version") if isinstance(raw, dict) else None
        if type(version) in (int, float) and version > COMMIT_VERSION:  # 2.0 is 2 to pydantic
            shown = version if abs(version) < 2**63 else "a huge number"
            raise MetadataError(
                f"{where}: commit record version {shown} is newer than this tdckpt reads "
                f"({COMMIT_VERSION}); upgrade tdckpt.",
                path=where,
            )
        record = CommitRecord.model_validate(raw)
        if b"\\ud" in data or b"\\uD" in data:
            # json reads a lone surrogate escape ("\\udcff") that UTF-8 cannot encode: the
            # manifest inside could never be written out again (a UnicodeEncodeError, a
            # ValueError, names the string)
            json.dumps(raw, ensure_ascii=False).encode("utf-8")
    except MetadataError:
        raise
    # ValueError: not UTF-8, not JSON, an integer past Python's digit limit, a schema error
    # (pydantic's ValidationError is one); RecursionError: nesting too deep to parse.
    except (ValidationError, ValueError, RecursionError, TypeError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, ValidationError) and exc.error_count():
            error = exc.errors(include_url=False, include_input=False)[0]
            where_in = ".".join(str(part) for part in error["loc"]) or "record"
            more = exc.error_count() - 1
            first = f"{where_in}: {error['msg']}" + (f"; and {more} more" if more else "")
        raise MetadataError(
            f"{where}: not a valid tdckpt commit record ({first[:200]}); the step cannot be "
            "restored. Restore another step; `tdckpt ls` lists it as damaged.",
            path=where,
        ) from exc
    if record.step != step:
        raise MetadataError(
            f"{where}: the record is for step {record.step}, not {step} (copied or renamed); "
            "it is not restored.",
            path=where,
        )
    return record
