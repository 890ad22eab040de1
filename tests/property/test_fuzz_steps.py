"""Step fuzzer: a changed manifest or commit record never costs another step its data.

Seeds are two manager roots with the kinds of step that share or pack data:

- a local root: a training state, a consolidated step (one data file), a full step and an
  incremental step whose unchanged leaves are links to the full step's files;
- an object-storage root (``memory://``): a training state, a full step whose large leaves
  are objects of their own, and an incremental step whose record names the full step's
  objects instead of uploading them again;
- an archive root (``archive=True``): a training state and two steps, stored and deflated;
- a sharded root: the sharded steps of ``test_fuzz_sharded.py`` (uneven shards, an empty
  one, a replicated entry), whose manifests change as that fuzzer changes them (shards,
  rows, world size, replicated entries; sealed again or not).

Each example copies one root and changes one step's manifest (local) or commit record
(object storage): any value anywhere (the generic JSON mutations of
``test_fuzz_metadata.py``), or on purpose the fields that say where data lies - a file's
path, size or key, a consolidated leaf's offset, a record's attempt, an object's name,
size or prefix (another step's attempt, outside the root), a location's offset. Other
examples damage one of the step's files, objects or archive members instead: deleted,
truncated, a byte flipped with size, mode and modification time kept (bit rot), swapped for
a symlink, or any byte of an archive flipped (headers and central directory included).

For every mutant, through ``CheckpointManager``:

- listing, ``verify``, ``restore`` and ``restore_into`` give a result or raise a
  :class:`~tdckpt.errors.TdckptError` - never another exception, never a hang;
- a restore gives exactly the step that was saved, or refuses with the target unchanged;
  where a file was damaged, ``verify=True`` restores of every step holding it refuse;
- reading writes nothing to the root;
- ``gc`` and then retention (``KeepLast(1)``) never delete or change what another step
  needs: every unchanged step that is still listed verifies and restores exactly, retention
  keeps the newest committed step, and a step whose manifest or record cannot be read is
  never deleted;
- a new incremental save, or ``save_async`` (whose base is the newest committed step, maybe
  the changed one)
  restores exactly what was saved, or its ``verify`` says it does not - never a step that
  verifies and holds other bytes (in an archive root, where nothing is shared, a new save
  always verifies).

``--fuzz-examples=N`` (or ``TDCKPT_FUZZ_EXAMPLES``) sets the number of examples:
``python -m pytest tests/property/test_fuzz_steps.py --fuzz-examples=2000``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import tempfile
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fuzz_settings, tree_digest
from hypothesis import event, given
from hypothesis import strategies as st

pytest.importorskip("tensordict")
from _shard_local import write_sharded
from tensordict import TensorDict
from test_fuzz_metadata import WATCHDOG_S, Mutable, snapshot, watchdog
from test_fuzz_sharded import SEEDS as SHARD_ROWS
from test_fuzz_sharded import _mutate_sharded, _shards, whole

from tdckpt import CheckpointManager, KeepLast
from tdckpt._shard.manifest import manifest_digest
from tdckpt.errors import TdckptError
from tdckpt.schema import MANIFEST_NAME

_EDGE = [0, 1, 3, 4, 8, 23, 24, 25, 48, 1 << 20, -1, 2**31, 2**63 - 1, 2**64, 10**30]

# -- the seeds ------------------------------------------------------------------------------


#: Which earlier step each step shares its unchanged leaves with (all but ``a``), by root:
#: the newest seed is incremental, and so is the save each example makes after the change.
SHARES = {False: {4: 3, 5: 4}, True: {3: 2, 4: 3}}
STATE_STEP = 1  # the training state of both roots


def _td(step: int, big: bool) -> TensorDict:
    """The TensorDict of ``step``: ``a`` differs from step to step, the other leaves are
    those of the step it shares with (:data:`SHARES`). ``big``: leaves of 1.2 MB, each an
    object of its own in object storage."""
    n = 300_000 if big else 6
    seed = step
    while seed in SHARES[big]:
        seed = SHARES[big][seed]
    td = TensorDict(
        a=torch.arange(n, dtype=torch.float32) * step,
        n=TensorDict(b=torch.arange(n, dtype=torch.int64) + seed, batch_size=[]),
        batch_size=[],
    )
    td["x.y"] = torch.full((3,), float(seed))
    td["s"] = f"run-{seed}"
    return td


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    if seed == STATE_STEP:  # the saved one has stepped, so its optimizer has moments
        model(torch.ones(1, 3)).sum().backward()
        optim.step()
    return {"model": model, "optim": optim}


def _state_digest(state: dict[str, Any]) -> Any:
    """The values of a training state's entries (no object identities)."""
    return {name: _values(snapshot(obj.state_dict())) for name, obj in state.items()}


#: The steps of each root.
SEEDS = {"local": [1, 2, 3, 4], "memory": [1, 2, 3], "archive": [1, 2, 3], "sharded": [1, 2, 3]}


@pytest.fixture(scope="module")
def local_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-steps") / "run"
    with CheckpointManager(root, fsync=False) as mgr:
        mgr.save(STATE_STEP, _state(STATE_STEP), metadata={"loss": 1.0})
    with CheckpointManager(root, fsync=False, layout="consolidated") as mgr:
        mgr.save(2, _td(2, big=False))
    with CheckpointManager(root, fsync=False, incremental=True) as mgr:
        mgr.save(3, _td(3, big=False))
        mgr.save(4, _td(4, big=False))
    return root


@pytest.fixture(scope="module")
def archive_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-steps-archive") / "run"
    with CheckpointManager(root, fsync=False, archive=True) as mgr:
        mgr.save(STATE_STEP, _state(STATE_STEP), metadata={"loss": 1.0})
        mgr.save(2, _td(2, big=False))
    with CheckpointManager(root, fsync=False, archive=True, compression="deflate") as mgr:
        mgr.save(3, _td(3, big=False))
    return root


@pytest.fixture(scope="module")
def sharded_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sharded steps of ``test_fuzz_sharded.py`` (uneven shards, an empty one, a
    replicated entry), as a collective save commits them."""
    root = tmp_path_factory.mktemp("fuzz-steps-sharded") / "run"
    for step in SEEDS["sharded"]:
        replicated = ("run",) if step != 3 else ()
        write_sharded(root, step, _shards(step), replicated=replicated, metadata={"s": step})
    return root


@pytest.fixture(scope="module")
def remote_root() -> Iterator[str]:
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://fuzz-steps-{uuid.uuid4().hex[:8]}/run"
    with CheckpointManager(url) as mgr:
        mgr.save(STATE_STEP, _state(STATE_STEP), metadata={"loss": 1.0})
    with CheckpointManager(url, incremental=True) as mgr:
        mgr.save(2, _td(2, big=True))
        mgr.save(3, _td(3, big=True))
    yield url
    fsspec.filesystem("memory").rm(url.split("://")[1].split("/")[0], recursive=True)


# -- comparing ------------------------------------------------------------------------------


def _same(got: Any, want: TensorDict, what: str) -> None:
    assert isinstance(got, TensorDict), f"{what}: restored a {type(got)}"
    keys = sorted(want.keys(True, True), key=str)
    assert sorted(got.keys(True, True), key=str) == keys, f"{what}: other keys"
    for key in keys:
        a, b = got.get(key), want.get(key)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype, f"{what}: {key}"
            assert torch.equal(a, b), f"{what}: other values at {key}"
        else:
            assert got[key] == want[key], f"{what}: other value at {key}"


class Root:
    """One copy of a seed root: its manager, its steps' references, its bytes."""

    def __init__(self, where: str | Path, kind: str) -> None:
        self.where = where
        self.kind = kind
        self.big = self.remote = kind == "memory"
        self.archive = kind == "archive"
        self.state_step = None if kind == "sharded" else STATE_STEP

    def reference(self, step: int) -> TensorDict:
        """What ``step`` holds (a training state aside)."""
        if self.kind == "sharded" and step in SHARD_ROWS:
            return whole(step)
        return _td(step, self.big)

    def manager(self, **kw: Any) -> CheckpointManager:
        return CheckpointManager(self.where, fsync=False, archive=self.archive, **kw)

    def digest(self) -> dict[str, str]:
        if not self.remote:
            return tree_digest(Path(self.where))
        import fsspec

        fs = fsspec.filesystem("memory")
        base = fs._strip_protocol(str(self.where))
        return {
            path: hashlib.sha256(fs.cat_file(path)).hexdigest()
            for path in fs.find(base)
            if "/.tdckpt-lease/" not in path
        }

    def check_step(
        self,
        mgr: CheckpointManager,
        step: int,
        what: str,
        *,
        damaged: bool = False,
        verify: bool = False,
    ) -> None:
        """``step`` restores exactly what was saved, or is refused (target unchanged).

        ``damaged``: a file of the step was damaged - restores verify first and must refuse;
        ``verify``: restores verify first (a change that may not be damage: either outcome).
        """
        kw = {"verify": True} if damaged or verify else {}
        if step == self.state_step:
            _into_or_refused(
                mgr,
                _state(0),
                step,
                kw,
                _state_digest,
                _state_digest(_state(STATE_STEP)),
                what,
                damaged,
            )
            return
        want = self.reference(step)
        try:
            got = mgr.restore(step, **kw)
        except TdckptError:
            pass
        else:
            assert not damaged, f"{what}: verify=True restored a damaged step"
            _same(got, want, f"{what}: restore")
        target = want.clone().apply(torch.zeros_like)
        for key in want.keys(True, True):
            if not isinstance(want.get(key), torch.Tensor):
                target[key] = "other"
        _into_or_refused(mgr, target, step, kw, snapshot, want, what, damaged)

    def check_intact(self, mgr: CheckpointManager, step: int, what: str) -> None:
        """An unchanged step verifies and restores exactly."""
        report = mgr.verify(step)
        assert report.ok, f"{what}: step {step} was damaged:\n{report.summary()}"
        if step == self.state_step:
            target = _state(0)
            mgr.restore_into(target, step)
            assert _state_digest(target) == _state_digest(_state(STATE_STEP)), what
        else:
            _same(mgr.restore(step), self.reference(step), f"{what}: step {step}")


def _into_or_refused(
    mgr: CheckpointManager,
    target: Any,
    step: int,
    kw: dict[str, Any],
    state: Callable[[Any], Any],
    want: Any,
    what: str,
    damaged: bool,
) -> None:
    """``restore_into(target, step)`` gives ``want`` (a TensorDict, compared leaf by leaf,
    or the ``state`` of a training state), or refuses with ``state(target)`` unchanged;
    a ``damaged`` step must be refused."""
    before = state(target)
    try:
        mgr.restore_into(target, step, **kw)
    except TdckptError:
        assert state(target) == before, f"{what}: a refused restore_into changed it"
        return
    assert not damaged, f"{what}: verify=True restored a damaged step"
    if isinstance(want, TensorDict):
        _same(target, want, f"{what}: restore_into")
    else:
        assert state(target) == want, f"{what}: restore_into"


def _values(digest: Any) -> Any:
    """A snapshot without object identities."""
    if isinstance(digest, tuple) and len(digest) >= 2 and isinstance(digest[1], int):
        return (digest[0], *(_values(d) for d in digest[2:]))
    if isinstance(digest, tuple):
        return tuple(_values(d) for d in digest)
    if isinstance(digest, dict):
        return {k: _values(v) for k, v in digest.items()}
    if isinstance(digest, list):
        return [_values(v) for v in digest]
    return digest


# -- mutations ------------------------------------------------------------------------------


def _generic(data: Any, doc: Any, name: str) -> tuple[Any, str]:
    ck = Mutable.__new__(Mutable)
    ck.docs, ck.pts, ck.dirty = {name: doc}, {}, set()
    what = ck.mutate_json(data)
    return ck.docs[name], what


def _pick(data: Any, items: list[Any], label: str) -> int:
    return data.draw(st.integers(0, len(items) - 1), label=label)


def _mutate_manifest(data: Any, doc: dict[str, Any], paths: list[str]) -> str:
    """One change, on purpose, to a field of a step manifest that says where data lies."""
    files = doc.get("files")
    ops = ["step", "key_encoding", "root_type"]
    if isinstance(files, list) and files and all(isinstance(f, dict) for f in files):
        ops += ["file", "file", "file", "drop file", "duplicate file"]
    cons = doc.get("consolidated")
    if isinstance(cons, dict) and isinstance(cons.get("leaves"), list) and cons["leaves"]:
        ops += ["leaf", "leaf", "consolidated file"]
    if doc.get("state") is not None:
        ops += ["state"]
    op = data.draw(st.sampled_from(ops), label="manifest op")
    if op == "step":
        doc["step"] = data.draw(st.sampled_from([1, 2, 3, 4, 5, 0, -1]), label="step")
        return f"step = {doc['step']}"
    if op == "key_encoding":
        doc["key_encoding"] = data.draw(st.sampled_from(["robust", "legacy", "none", "x"]))
        return f"key_encoding = {doc['key_encoding']}"
    if op == "root_type":
        doc["root_type"] = data.draw(
            st.sampled_from(["tensordict:TensorDict", "tensordict:LazyStackedTensorDict", "x:Y"])
        )
        return f"root_type = {doc['root_type']}"
    if op == "state":
        doc["state"] = data.draw(st.sampled_from([None, {}, {"entries": {}}, []]), label="state")
        return f"state = {doc['state']}"
    if op in ("leaf", "consolidated file"):
        assert isinstance(cons, dict)
        if op == "consolidated file":
            cons["file"] = data.draw(
                st.sampled_from(["meta.json", "../1/a.memmap", "a.memmap", "", "x/../y"]),
                label="file",
            )
            return f"consolidated.file = {cons['file']}"
        leaves = cons["leaves"]
        i = _pick(data, leaves, "leaf")
        field = data.draw(st.sampled_from(["offset", "size", "key", "checksum"]), label="field")
        value: Any
        if field == "key":
            value = data.draw(st.sampled_from([["a"], ["n", "b"], ["ghost"], [], None]))
        elif field == "checksum":
            value = data.draw(st.sampled_from([None, "crc32:00000000", leaves[-1 - i].get(field)]))
        else:
            value = data.draw(st.sampled_from(_EDGE), label=field)
        if isinstance(leaves[i], dict):
            leaves[i][field] = value
        return f"consolidated.leaves[{i}].{field} = {value}"
    assert isinstance(files, list)
    i = _pick(data, files, "file")
    if op == "drop file":
        gone = files.pop(i)
        return f"drop {gone.get('path')}"
    if op == "duplicate file":
        files.insert(_pick(data, files, "at"), copy.deepcopy(files[i]))
        return f"duplicate {files[i].get('path')}"
    field = data.draw(st.sampled_from(["path", "size", "key", "checksum"]), label="field")
    if field == "path":
        value = data.draw(
            st.sampled_from([*paths, "../1/a.memmap", "/etc/passwd", "a.memmap/", "ghost.memmap"]),
            label="path",
        )
    elif field == "key":
        value = data.draw(st.sampled_from([["a"], ["n", "b"], ["x.y"], ["ghost"], None]))
    elif field == "checksum":
        other = files[-1 - i].get("checksum")
        value = data.draw(st.sampled_from([None, other, "sha256:" + "0" * 64]), label="checksum")
    else:
        value = data.draw(st.sampled_from(_EDGE), label="size")
    files[i][field] = value
    return f"files[{i}].{field} = {value}"


def _mutate_record(data: Any, doc: dict[str, Any], attempts: list[str]) -> str:
    """One change, on purpose, to a field of a commit record that says where data lies."""
    objects = doc.get("objects")
    locations = doc.get("locations")
    ops = ["attempt", "step", "commit_version"]
    if isinstance(objects, list) and objects and all(isinstance(o, dict) for o in objects):
        ops += ["object", "object", "object", "drop object", "swap objects"]
    if isinstance(locations, dict) and locations:
        ops += ["location", "location"]
    op = data.draw(st.sampled_from(ops), label="record op")
    if op == "attempt":
        doc["attempt"] = data.draw(
            st.sampled_from([*attempts, "../x", "", "0" * 32, doc.get("attempt", "") + "0"]),
            label="attempt",
        )
        return f"attempt = {doc['attempt']}"
    if op == "step":
        doc["step"] = data.draw(st.sampled_from([1, 2, 3, 0, -1, 2**63]), label="step")
        return f"step = {doc['step']}"
    if op == "commit_version":
        doc["commit_version"] = data.draw(st.sampled_from([0, 1, 2, 3]), label="version")
        return f"commit_version = {doc['commit_version']}"
    if op == "location":
        assert isinstance(locations, dict)
        path = data.draw(st.sampled_from(sorted(locations)), label="location")
        field = data.draw(st.sampled_from(["object", "offset"]), label="field")
        value = data.draw(st.sampled_from(_EDGE), label=field)
        if isinstance(locations[path], dict):
            locations[path][field] = value
        return f"locations[{path}].{field} = {value}"
    assert isinstance(objects, list)
    if op == "drop object":
        i = _pick(data, objects, "object")
        gone = objects.pop(i)
        return f"drop object {gone}"
    if op == "swap objects" and len(objects) > 1:
        i, j = data.draw(st.permutations(range(len(objects))), label="swap")[:2]
        objects[i], objects[j] = objects[j], objects[i]
        return f"swap objects {i} and {j}"
    i = _pick(data, objects, "object")
    field = data.draw(st.sampled_from(["name", "size", "prefix"]), label="field")
    value: Any
    if field == "prefix":
        value = data.draw(
            st.sampled_from(
                [*attempts, "../other/1.attempt-0", "/abs", "", ".", "1.attempt-" + "0" * 32]
            ),
            label="prefix",
        )
    elif field == "name":
        names = [o.get("name") for o in objects]
        value = data.draw(st.sampled_from([*names, "../data-0", "", "data-9"]), label="name")
    else:
        value = data.draw(st.sampled_from(_EDGE), label="size")
    objects[i][field] = value
    return f"objects[{i}].{field} = {value}"


# -- copying and changing a root ------------------------------------------------------------


def _copy_remote(seed: str) -> str:
    import fsspec

    fs = fsspec.filesystem("memory")
    src = fs._strip_protocol(seed)
    url = f"memory://fuzz-steps-{uuid.uuid4().hex}/run"
    dst = fs._strip_protocol(url)
    for path in fs.find(src):
        if "/.tdckpt-lease/" not in path:
            fs.pipe_file(dst + path[len(src) :], fs.cat_file(path))
    return url


def _drop_remote(url: str) -> None:
    import fsspec

    fsspec.filesystem("memory").rm(url.split("://")[1].split("/")[0], recursive=True)


def _changed_manifest(
    data: Any, doc: Any, on_purpose: Callable[[Any, dict[str, Any]], str] | None = None
) -> tuple[Any, list[str]]:
    """A step manifest after one or two changes, generic or ``on_purpose`` (default: the
    fields of a plain step manifest that say where data lies), and what they were."""
    if on_purpose is None:
        paths = [f["path"] for f in doc["files"]]
        on_purpose = functools.partial(_mutate_manifest, paths=paths)
    done = []
    for _ in range(data.draw(st.integers(1, 2), label="changes")):
        if data.draw(st.integers(0, 2), label="generic?") == 0 or not isinstance(doc, dict):
            doc, what = _generic(data, doc, MANIFEST_NAME)
            done.append(what)
        else:
            done.append(on_purpose(data, doc))
    return doc, done


def _change_local(data: Any, root: Path, step: int) -> tuple[str, Path]:
    manifest = root / str(step) / MANIFEST_NAME
    doc, done = _changed_manifest(data, json.loads(manifest.read_text()))
    manifest.write_text(json.dumps(doc))
    return "; ".join(done), root / str(step)


def _change_sharded(data: Any, root: Path, step: int) -> tuple[str, Path]:
    """A sharded step's manifest changed (generic, or its shards, rows and replicated
    entries on purpose), sealed again with its checksum or left stale."""
    manifest = root / str(step) / MANIFEST_NAME
    doc, done = _changed_manifest(data, json.loads(manifest.read_text()), _mutate_sharded)
    if isinstance(doc, dict) and data.draw(st.integers(0, 4), label="reseal") > 0:
        doc["manifest_checksum"] = manifest_digest(doc)
        done.append("resealed")
    manifest.write_text(json.dumps(doc))
    return "; ".join(done), root / str(step)


def _change_remote(data: Any, url: str, step: int) -> tuple[str, str]:
    import fsspec

    fs = fsspec.filesystem("memory")
    base = fs._strip_protocol(url)
    record = f"{base}/{step}.tdckpt.json"
    doc = json.loads(fs.cat_file(record))
    attempts = sorted(p.rsplit("/", 1)[1] for p in fs.ls(base, detail=False) if ".attempt-" in p)
    done = []
    for _ in range(data.draw(st.integers(1, 2), label="changes")):
        choice = data.draw(st.integers(0, 3), label="what")
        if choice == 0 or not isinstance(doc, dict):
            doc, what = _generic(data, doc, "record")
            done.append(what)
        elif choice == 1 and isinstance(doc.get("manifest"), dict):
            done.append("manifest: " + _mutate_manifest(data, doc["manifest"], []))
        else:
            done.append(_mutate_record(data, doc, attempts))
    fs.pipe_file(record, json.dumps(doc).encode())
    return "; ".join(done), record


def _damage_local(data: Any, root: Path, step: int, seeds: list[int]) -> tuple[str, set[int]]:
    """Damage one file of ``step`` on disk; return what, and the steps that hold it (an
    incremental step's leaf is a hard link: damaging its bytes damages every step)."""
    folder = root / str(step)
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME and p.stat().st_size > 0
    )
    victim = data.draw(st.sampled_from(files), label="file")
    st0 = victim.stat()
    hit = {
        s
        for s in seeds
        if any(p.stat().st_ino == st0.st_ino for p in (root / str(s)).rglob("*") if p.is_file())
    }
    op = data.draw(st.sampled_from(["delete", "truncate", "flip", "symlink"]), label="damage")
    rel = victim.relative_to(root).as_posix()
    if op in ("delete", "symlink"):
        others = sorted(p for p in root.rglob("*") if p.is_file() and p != victim)
        victim.unlink()  # one name of the inode: only this step loses it
        if op == "symlink":  # to a file of this step or another
            victim.symlink_to(data.draw(st.sampled_from(others), label="to"))
        return f"{op} {rel}", {step}
    os.chmod(victim, st0.st_mode | 0o200)  # an incremental leaf is read-only
    with open(victim, "r+b") as fh:
        if op == "truncate":
            fh.truncate(st0.st_size // 2)
        else:  # bit rot: the same size, mode and modification time
            at = data.draw(st.integers(0, st0.st_size - 1), label="at")
            fh.seek(at)
            byte = fh.read(1)[0]
            fh.seek(at)
            fh.write(bytes([byte ^ 0xFF]))
    os.chmod(victim, st0.st_mode)
    os.utime(victim, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    return f"{op} {rel}", hit


def _damage_remote(data: Any, url: str, step: int, seeds: list[int]) -> tuple[str, set[int]]:
    """Damage one object of ``step``'s own attempt; return what, and the steps whose
    records name it (an incremental record names an earlier step's objects)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    base = fs._strip_protocol(url)
    records = {s: json.loads(fs.cat_file(f"{base}/{s}.tdckpt.json")) for s in seeds}
    own = f"{step}.attempt-{records[step]['attempt']}"
    victim = data.draw(st.sampled_from(sorted(fs.find(f"{base}/{own}"))), label="object")
    name = victim.rsplit("/", 1)[1]
    hit = {
        s
        for s, rec in records.items()
        for obj in rec["objects"]
        if obj["name"] == name and obj.get("prefix", f"{s}.attempt-{rec['attempt']}") == own
    }
    op = data.draw(st.sampled_from(["delete", "truncate", "flip"]), label="damage")
    raw = bytearray(fs.cat_file(victim))
    if op == "delete":
        fs.rm(victim)
    elif op == "truncate":
        fs.pipe_file(victim, bytes(raw[: len(raw) // 2]))
    else:
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[at] ^= 0xFF
        fs.pipe_file(victim, bytes(raw))
    return f"{op} {own}/{name}", hit


def _rewrite_zip(path: Path, change: Callable[[str, bytes], bytes | None]) -> None:
    """Rewrite the archive ``path`` with each member's bytes passed through ``change``
    (None drops the member), keeping names, order and compression."""
    with zipfile.ZipFile(path) as zf:
        members = [(info, zf.read(info)) for info in zf.infolist()]
    with zipfile.ZipFile(path, "w") as zf:
        for info, raw in members:
            new = change(info.filename, raw)
            if new is not None:
                zf.writestr(info, new, compress_type=info.compress_type)


def _change_archive(data: Any, root: Path, step: int) -> tuple[str, Path]:
    entry = root / f"{step}.tdz"
    with zipfile.ZipFile(entry) as zf:
        doc, done = _changed_manifest(data, json.loads(zf.read(MANIFEST_NAME)))
    raw = json.dumps(doc).encode()
    _rewrite_zip(entry, lambda name, old: raw if name == MANIFEST_NAME else old)
    return "; ".join(done), entry


def _damage_archive(data: Any, root: Path, step: int, seeds: list[int]) -> tuple[str, set[int]]:
    """Damage a member of ``step``'s archive, or any byte of the archive file itself."""
    entry = root / f"{step}.tdz"
    with zipfile.ZipFile(entry) as zf:
        names = [n for n in zf.namelist() if n != MANIFEST_NAME and zf.getinfo(n).file_size]
    op = data.draw(st.sampled_from(["delete", "truncate", "flip", "flip any byte"]))
    if op == "flip any byte":  # headers, the central directory, compressed data: anything
        raw = bytearray(entry.read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[at] ^= data.draw(st.integers(1, 255), label="xor")
        entry.write_bytes(bytes(raw))
        return f"{op} at {at} of {entry.name}", {step}
    victim = data.draw(st.sampled_from(names), label="member")

    def change(name: str, raw: bytes) -> bytes | None:
        if name != victim:
            return raw
        if op == "delete":
            return None
        if op == "truncate":
            return raw[: len(raw) // 2]
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        return raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1 :]

    _rewrite_zip(entry, change)
    return f"{op} {entry.name}:{victim}", {step}


def _exists(root: Root, entry: Path | str) -> bool:
    if not root.remote:
        return Path(entry).exists()
    import fsspec

    return bool(fsspec.filesystem("memory").exists(str(entry)))


# -- the contract ---------------------------------------------------------------------------


def _check(
    root: Root,
    changed: int,
    entry: Path | str,
    seeds: list[int],
    what: str,
    hit: set[int] | None = None,
    sure: bool = True,
    save_async: bool = False,
) -> str:
    """The contract (module doc) on one root whose step ``changed`` was changed: its
    manifest or record, or (``hit``: the steps that hold it) one of its files - a change
    that is ``sure`` to damage its data, or one that may not (a byte of a zip header)."""
    before = root.digest()
    intact = [s for s in seeds if s != changed and s not in (hit or ())]
    with root.manager() as mgr:
        listed = mgr.steps()
        mgr.list_steps()
        assert set(intact) <= set(listed), f"{what}: an unchanged step is no longer listed"
        committed = changed in listed
        try:
            report = mgr.verify(changed)
        except TdckptError:
            pass
        else:
            assert hasattr(report, "ok"), what
        with contextlib.suppress(TdckptError):
            mgr.metadata(changed)
        if hit is None:
            root.check_step(mgr, changed, what)
        else:
            if sure:  # (a flipped byte of an archive may be one of its manifest)
                assert committed, f"{what}: a step whose manifest is intact is not listed"
            for step in sorted(hit):
                root.check_step(mgr, step, f"{what}, step {step}", damaged=sure, verify=True)
    assert root.digest() == before, f"{what}: reading wrote to the root"
    with root.manager() as mgr:
        mgr.gc(grace_period=0)
        assert set(intact) <= set(mgr.steps()), f"{what}: gc removed a committed step"
        for step in intact:
            root.check_intact(mgr, step, f"{what}, after gc")
        if not committed:
            assert _exists(root, entry), f"{what}: gc deleted a step it could not read"
    with root.manager(retention=KeepLast(1)) as mgr:
        newest = max(mgr.steps(), default=None)
        mgr.prune()
        assert mgr.steps() == ([] if newest is None else [newest]), f"{what}: retention"
        if newest in intact:
            root.check_intact(mgr, newest, f"{what}, after retention")
        if not committed:
            assert _exists(root, entry), f"{what}: retention deleted a step it could not read"
    new = max(seeds) + 1
    with root.manager(incremental=not root.archive) as mgr:
        want = _td(new, root.big)
        if save_async:
            mgr.save_async(new, want).result()
        else:
            mgr.save(new, want)
        report = mgr.verify(new)
        if root.archive:  # nothing shared: the new step is exact, whatever the others hold
            assert report.ok, f"{what}: a new archive step does not verify"
        try:
            got = mgr.restore(new)
        except TdckptError:  # object storage checks what it reads: a damaged base shows
            assert not report.ok, f"{what}: a new step that verifies does not restore"
        else:
            if report.ok:
                _same(got, want, f"{what}: a new step that verifies")
    if hit is not None:
        return "data"
    return "committed" if committed else "damaged"


def _run(data: Any, make: Callable[[], tuple[Root, Callable[[], None]]], seeds: list[int]) -> str:
    root, drop = make()
    try:
        step = data.draw(st.sampled_from(seeds), label="step")
        hit: set[int] | None = None
        entry: Path | str
        if data.draw(st.integers(0, 3), label="damage data?") == 0:
            if root.remote:
                what, hit = _damage_remote(data, str(root.where), step, seeds)
            elif root.archive:
                what, hit = _damage_archive(data, Path(root.where), step, seeds)
            else:
                what, hit = _damage_local(data, Path(root.where), step, seeds)
            entry = root.where
        elif root.remote:
            what, entry = _change_remote(data, str(root.where), step)
        elif root.archive:
            what, entry = _change_archive(data, Path(root.where), step)
        elif root.kind == "sharded":
            what, entry = _change_sharded(data, Path(root.where), step)
        else:
            what, entry = _change_local(data, Path(root.where), step)
        what = f"step {step}: {what}"
        with watchdog(WATCHDOG_S, what), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # a flipped byte of an archive may be one no reader looks at (a time stamp)
            return _check(
                root,
                step,
                entry,
                seeds,
                what,
                hit,
                sure="any byte" not in what,
                save_async=data.draw(st.booleans(), label="save_async"),
            )
    finally:
        drop()


ROOTS = {
    "local": "local_root",
    "memory": "remote_root",
    "archive": "archive_root",
    "sharded": "sharded_root",
}


def test_the_seeds_restore(request: pytest.FixtureRequest) -> None:
    for kind, fixture in ROOTS.items():
        root = Root(request.getfixturevalue(fixture), kind)
        with root.manager() as mgr:
            assert mgr.steps() == SEEDS[kind]
            for step in SEEDS[kind]:
                root.check_intact(mgr, step, "seed")
            if kind in ("local", "memory"):  # the incremental seeds do share their leaves
                assert mgr.shared_bytes()[mgr.steps()[-1]] > 0


@pytest.mark.parametrize("kind", sorted(ROOTS))
def test_fuzz_steps(fuzz_examples: int, kind: str, request: pytest.FixtureRequest) -> None:
    seed = request.getfixturevalue(ROOTS[kind])
    examples = fuzz_examples if kind == "local" else max(fuzz_examples // 2, 10)
    outcomes = dict.fromkeys(("committed", "damaged", "data"), 0)

    def make() -> tuple[Root, Callable[[], None]]:
        if kind == "memory":
            url = _copy_remote(seed)
            return Root(url, kind), lambda: _drop_remote(url)
        tmp = tempfile.mkdtemp(prefix="tdckpt-fuzz-steps-")
        shutil.copytree(seed, Path(tmp) / "run", symlinks=True)
        return Root(Path(tmp) / "run", kind), lambda: shutil.rmtree(tmp)

    @fuzz_settings(examples)
    @given(data=st.data())
    def run(data: Any) -> None:
        outcome = _run(data, make, SEEDS[kind])
        outcomes[outcome] += 1
        event(outcome)

    run()
    print(f"step fuzzer ({kind}): {outcomes}")
    if examples >= 50:  # not a vacuous run: changed steps both still listed and damaged
        assert outcomes["committed"] and outcomes["damaged"], outcomes
