"""Check a checkpoint written by TorchRL's ``torchrl.checkpoint.Checkpoint``; TorchRL not needed.

TorchRL writes ``manifest.json`` (``"format": "torchrl.checkpoint"``) and one folder per
component under ``components/``, each listing its files, as a directory or as a zip archive
of that tree. TorchRL keeps no checksums, so :func:`check_torchrl_checkpoint` checks what can
be checked without them, reading no tensor byte it does not have to:

* the manifest is TorchRL's, every component record is well formed, every listed file is
  present and a regular file (in the archive: a member), and no member path escapes;
* every tensordict payload (a folder with ``meta.json``: TorchRL's state-dict ``state/``, a
  replay buffer's ``storage/``; a ``.tdz``) is validated by tdckpt's reader;
* a component written by :class:`tdckpt.torchrl.TdckptAdapter` is also verified against the
  checksums its tdckpt manifest recorded (a flipped byte is found);
* every ``.json`` file parses;
* ``torch.save`` payloads (``state.pt``) and other pickles (``prefetch.pkl``) are reported
  as pickles: loading them runs code from the file (info, not an error).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tdckpt._report import Problem, ProblemList
from tdckpt.errors import TdckptError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "ComponentReport",
    "RotationEntry",
    "TorchRLCheckpointReport",
    "check_torchrl_checkpoint",
    "is_torchrl_checkpoint",
    "rotation_entries",
]

#: What TorchRL's manifest says its format is.
FORMAT = "torchrl.checkpoint"
#: TorchRL's manifest, at the checkpoint's root.
MANIFEST = "manifest.json"
#: The largest manifest read (TorchRL's are a few KiB).
_MAX_MANIFEST = 16 * 1024 * 1024
#: File names that hold pickles (``torch.save``, TorchRL's prefetch queue).
_PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle")
#: The folder :class:`tdckpt.torchrl.TdckptAdapter` writes a component's payload into.
_TDCKPT_PAYLOAD = "tdckpt"


@dataclass
class ComponentReport:
    """One component of a TorchRL checkpoint, as checked."""

    name: str
    adapter: str
    path: str
    files: int = 0
    bytes: int = 0
    tensordicts: list[str] = field(default_factory=list)
    leaves: int = 0
    pickles: list[str] = field(default_factory=list)
    verified: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TorchRLCheckpointReport(ProblemList):
    """What :func:`check_torchrl_checkpoint` found: each component, and every problem at once.

    ``ok``: every listed file is present and every payload tdckpt can read is valid.
    """

    path: str
    container: str
    manifest: dict[str, Any] = field(default_factory=dict)
    components: list[ComponentReport] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": FORMAT,
            "container": self.container,
            "ok": self.ok,
            "versions": self.manifest.get("versions"),
            "components": [c.to_json() for c in self.components],
            "problems": [p.to_json() for p in self.problems],
        }


def _read_manifest_bytes(path: Path) -> bytes | None:
    """The bytes of TorchRL's manifest at ``path`` (folder or zip), or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        where = path / MANIFEST
        try:
            if not stat.S_ISREG(os.lstat(where).st_mode) or os.lstat(where).st_size > _MAX_MANIFEST:
                return None
            return where.read_bytes()
        except OSError:
            return None
    if stat.S_ISREG(st.st_mode) and zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                info = archive.getinfo(MANIFEST)
                if info.file_size > _MAX_MANIFEST:
                    return None
                return archive.read(info)
        except (KeyError, OSError, zipfile.BadZipFile):
            return None
    return None


def _loads(raw: bytes) -> Any:
    """Parse JSON; ValueError for anything that is not JSON (nesting too deep included)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def is_torchrl_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a TorchRL checkpoint (its manifest says ``torchrl.checkpoint``)."""
    raw = _read_manifest_bytes(Path(path))
    if raw is None:
        return False
    try:
        manifest = _loads(raw)
    except ValueError:
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _safe(rel: str) -> PurePosixPath | None:
    """``rel`` as a relative path inside the checkpoint, or None when it could escape."""
    p = PurePosixPath(rel.replace("\\", "/"))
    if (
        not rel
        or "\0" in rel
        or p.is_absolute()
        or ".." in p.parts
        or any(":" in part for part in p.parts[:1])
    ):
        return None
    return p


def _error(code: str, path: str, message: str) -> Problem:
    return Problem(code=code, severity="error", path=path, key=(), message=message)


def check_torchrl_checkpoint(
    path: str | os.PathLike[str], *, inspect_payloads: bool = True
) -> TorchRLCheckpointReport:
    """Check a TorchRL checkpoint (directory or zip archive); nothing is written or loaded.

    Args:
        path: the checkpoint, as given to ``Checkpoint.save``.
        inspect_payloads: also count the leaves of each tensordict payload (metadata only).

    Returns:
        A :class:`TorchRLCheckpointReport`; ``ok`` is False when a file is missing, a
        payload is invalid or a tdckpt payload fails its checksums (each a problem naming
        the component and the file).
    """
    src = Path(path)
    container = "directory" if src.is_dir() else "archive"
    report = TorchRLCheckpointReport(path=os.fspath(path), container=container)
    raw = _read_manifest_bytes(src)
    if raw is None:
        report.problems.append(
            _error(
                "not-found",
                MANIFEST,
                f"{path}: no TorchRL manifest ({MANIFEST}) here; not a torchrl.checkpoint "
                "directory or archive.",
            )
        )
        return report
    try:
        manifest = _loads(raw)
    except ValueError as exc:
        report.problems.append(_error("bad-manifest", MANIFEST, f"not JSON: {exc}"))
        return report
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        report.problems.append(
            _error(
                "bad-manifest", MANIFEST, f"its format is not {FORMAT!r}; not a TorchRL checkpoint"
            )
        )
        return report
    report.manifest = manifest
    components = manifest.get("components")
    if not isinstance(components, dict):
        report.problems.append(_error("bad-manifest", MANIFEST, "it has no 'components' mapping"))
        return report
    with _materialized(src, container) as root:
        for name, record in components.items():
            _check_component(root, str(name), record, report, inspect_payloads)
    return report


@contextmanager
def _materialized(src: Path, container: str) -> Iterator[Path | zipfile.ZipFile]:
    if container == "directory":
        yield src
        return
    with zipfile.ZipFile(src) as archive:
        yield archive


def _check_component(
    root: Path | zipfile.ZipFile,
    name: str,
    record: Any,
    report: TorchRLCheckpointReport,
    inspect_payloads: bool,
) -> None:
    where = f"component {name!r}"
    if not isinstance(record, dict):
        report.problems.append(_error("bad-manifest", MANIFEST, f"{where}: not a mapping"))
        return
    adapter, rel, files = record.get("adapter"), record.get("path"), record.get("files")
    if not isinstance(adapter, str) or not isinstance(rel, str) or not isinstance(files, list):
        report.problems.append(
            _error("bad-manifest", MANIFEST, f"{where}: needs 'adapter', 'path' and 'files'")
        )
        return
    base = _safe(rel)
    if base is None:
        report.problems.append(
            _error("unsafe-path", rel, f"{where}: its path escapes the checkpoint")
        )
        return
    comp = ComponentReport(name=name, adapter=adapter, path=base.as_posix())
    report.components.append(comp)
    listed: list[PurePosixPath] = []
    for entry in files:
        member = _safe(entry) if isinstance(entry, str) else None
        if member is None:
            report.problems.append(
                _error("unsafe-path", base.as_posix(), f"{where}: unsafe file entry {entry!r}")
            )
            continue
        listed.append(member)
    if isinstance(root, zipfile.ZipFile):
        with tempfile.TemporaryDirectory(prefix="tdckpt-torchrl-") as tmp:
            local = Path(tmp)
            present = _extract(root, base, listed, local, comp, report, where)
            _check_payloads(local, base, present, comp, report, where, inspect_payloads)
        return
    present = []
    for member in listed:
        full = root / base / member
        try:
            st = os.lstat(full)
        except OSError:
            report.problems.append(
                _error("missing-file", (base / member).as_posix(), f"{where}: listed, missing")
            )
            continue
        if not stat.S_ISREG(st.st_mode):
            report.problems.append(
                _error("not-a-file", (base / member).as_posix(), f"{where}: not a regular file")
            )
            continue
        comp.files += 1
        comp.bytes += st.st_size
        present.append(member)
    _check_payloads(root / base, base, present, comp, report, where, inspect_payloads)


def _extract(
    archive: zipfile.ZipFile,
    base: PurePosixPath,
    listed: list[PurePosixPath],
    dest: Path,
    comp: ComponentReport,
    report: TorchRLCheckpointReport,
    where: str,
) -> list[PurePosixPath]:
    present: list[PurePosixPath] = []
    declared = 0
    for member in listed:
        with contextlib.suppress(KeyError):
            declared += archive.getinfo((base / member).as_posix()).file_size
    free = shutil.disk_usage(dest).free
    if declared > free // 2:  # a hostile archive must not fill the disk
        report.problems.append(
            _error(
                "too-large",
                base.as_posix(),
                f"{where}: its members declare {declared} bytes, more than half the "
                f"{free} bytes free in {dest.parent}; not unpacked, not checked. Extract the "
                "archive yourself and check the directory.",
            )
        )
        return present
    for member in listed:
        name = (base / member).as_posix()
        try:
            info = archive.getinfo(name)
        except KeyError:
            report.problems.append(
                _error("missing-file", name, f"{where}: listed, not in the archive")
            )
            continue
        target = dest / member
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as fin, open(target, "wb") as fout:
                shutil.copyfileobj(fin, fout)
        except (OSError, zipfile.BadZipFile, EOFError) as exc:  # a bad CRC, a short member
            # (an OSError names the scratch folder: say what it means for the archive)
            why = (
                f"cannot be unpacked ({exc.strerror}: a member is also a folder of members, "
                "or the disk is full)"
                if isinstance(exc, OSError) and exc.strerror
                else str(exc)
            )
            report.problems.append(_error("unreadable", name, f"{where}: {why}"))
            continue
        comp.files += 1
        comp.bytes += info.file_size
        present.append(member)
    return present


def _check_payloads(
    local: Path,
    base: PurePosixPath,
    present: list[PurePosixPath],
    comp: ComponentReport,
    report: TorchRLCheckpointReport,
    where: str,
    inspect_payloads: bool,
) -> None:
    from tdckpt._read.inspect import inspect, validate

    names = set(present)
    # tensordict roots: folders with meta.json whose parent has none
    roots = sorted(
        {
            m.parent
            for m in present
            if m.name == "meta.json"
            and (m.parent.parent / "meta.json") not in names
            and m.parent != PurePosixPath(".")
        }
        | {m for m in present if m.suffix == ".tdz"},
        key=lambda p: (len(p.parts), p.as_posix()),
    )
    # a component TdckptAdapter wrote: its whole payload is one tdckpt checkpoint
    tdckpt_payload = PurePosixPath(_TDCKPT_PAYLOAD) / "tdckpt.manifest.json" in names
    inside: list[PurePosixPath] = []
    for td_root in roots:
        if any(td_root.is_relative_to(r) and td_root != r for r in inside):
            continue
        inside.append(td_root)
        shown = (base / td_root).as_posix()
        comp.tensordicts.append(shown)
        result = validate(local / td_root)
        for p in result.problems:
            path = f"{shown}/{p.path}" if p.path else shown
            report.problems.append(
                Problem(p.code, p.severity, path, p.key, f"{where}: {p.message}")
            )
        if inspect_payloads and result.ok:
            with contextlib.suppress(TdckptError):  # validate said ok; counting is a bonus
                comp.leaves += inspect(local / td_root).leaf_count
    if tdckpt_payload:
        _verify_tdckpt(local / _TDCKPT_PAYLOAD, base / _TDCKPT_PAYLOAD, comp, report, where)
    for member in present:
        if any(member.is_relative_to(r) for r in inside):
            continue
        shown = (base / member).as_posix()
        if member.suffix == ".json":
            try:
                _loads((local / member).read_bytes())
            except (ValueError, OSError) as exc:
                report.problems.append(_error("bad-json", shown, f"{where}: not JSON ({exc})"))
        elif member.suffix in _PICKLE_SUFFIXES:
            comp.pickles.append(shown)
            what = "a torch.save payload" if member.suffix in (".pt", ".pth") else "a pickle"
            report.problems.append(
                Problem(
                    "pickle",
                    "info",
                    shown,
                    (),
                    f"{where}: {what}; loading it unpickles (runs code from the file). "
                    "tdckpt cannot check its contents; load it only from a trusted source.",
                )
            )


def _verify_tdckpt(
    payload: Path,
    shown: PurePosixPath,
    comp: ComponentReport,
    report: TorchRLCheckpointReport,
    where: str,
) -> None:
    import threading

    from tdckpt._manage.steps import StepIndex
    from tdckpt._manage.verify import verify_files
    from tdckpt.errors import MetadataError

    try:
        manifest = StepIndex(payload.parent, threading.RLock()).manifest(payload, "dir")
    except MetadataError as exc:
        report.problems.append(_error("bad-manifest", shown.as_posix(), f"{where}: {exc}"))
        return
    result = verify_files(manifest.step or 0, payload, manifest, archive=False)
    for p in result.problems:
        report.problems.append(
            _error(
                f"checksum-{p.kind}",
                f"{shown.as_posix()}/{p.path}",
                f"{where}: {p.kind}: expected {p.expected}, found {p.found}",
            )
        )
    comp.verified = result.ok


@dataclass(frozen=True)
class RotationEntry:
    """One checkpoint of a TorchRL ``CheckpointRotation`` folder."""

    step: int
    path: Path
    container: str
    created_at: str | None
    metadata: dict[str, Any]
    components: list[str]
    size: int

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["path"] = os.fspath(self.path)
        return data


def rotation_entries(root: str | os.PathLike[str]) -> list[RotationEntry] | None:
    """The checkpoints of a TorchRL ``CheckpointRotation`` folder, by step; None when ``root``
    is not one (no ``<prefix>-<step>`` / ``<prefix>-<step>.torchrl`` TorchRL checkpoint in it,
    or it holds tdckpt steps: folders named by plain decimal numbers).

    Reads only the manifests; a damaged entry is listed with what could be read.
    """
    folder = Path(root)
    try:
        children = sorted(folder.iterdir()) if folder.is_dir() else None
    except OSError:
        return None
    if children is None or any(_decimal(c.name) for c in children):
        return None
    found: list[RotationEntry] = []
    for child in children:
        name = child.name.removesuffix(".torchrl")
        head, sep, digits = name.rpartition("-")
        if not sep or not head or not _decimal(digits):
            continue
        raw = _read_manifest_bytes(child)
        try:
            manifest = _loads(raw) if raw is not None else None
        except ValueError:
            manifest = None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            continue
        comps = manifest.get("components")
        found.append(
            RotationEntry(
                step=int(digits),
                path=child,
                container="archive" if child.is_file() else "directory",
                created_at=str(manifest.get("created_at")) if manifest.get("created_at") else None,
                metadata=meta if isinstance(meta := manifest.get("metadata"), dict) else {},
                components=sorted(comps) if isinstance(comps, dict) else [],
                size=_size(child),
            )
        )
    if not found:
        return None
    return sorted(found, key=lambda e: (e.step, e.created_at or "", e.path.name))


def _decimal(text: str) -> bool:
    """Plain ASCII digits (``str.isdigit`` also takes ``"²"``, which ``int`` refuses)."""
    return text.isascii() and text.isdigit()


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(d, f)).st_size
    return total
