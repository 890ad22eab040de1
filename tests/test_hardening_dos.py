"""Denial of service: a few kilobytes of hostile metadata never cost gigabytes or minutes.

Each hostile prefix is read (``validate`` then ``load_memmap``) in one child process that runs
under a memory limit (``RLIMIT_AS``: 3 GiB above what the child holds once torch is
imported) and a per-case alarm; the test asserts a clear ``TdckptError`` naming the file,
within a few seconds, and no crash. Before these budgets, each case either hung (a symlinked
directory DAG walked 2**40 paths), or inflated / expanded its few kilobytes into gigabytes.

Cheaper properties (what the budgets leave alone, where they stop) run in-process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TESTS_DIR, copy_case, subprocess_env, tree_digest
from tensordict import TensorDict

import tdckpt
from tdckpt._read.opener import open_storage
from tdckpt._read.storage import MAX_JSON_BYTES
from tdckpt._read.tree import read_tree
from tdckpt.errors import MetadataError, ValidationError
from tdckpt.warnings import TdckptWarning

REPO = TESTS_DIR.parent
LS = "<class 'tensordict._lazy.LazyStackedTensorDict'>"
NTD = "<class 'tensordict.tensorclass.NonTensorData'>"
TD = "<class 'tensordict._td.TensorDict'>"
#: Wall-clock seconds one hostile case may take in the child (they take well under one).
CASE_SECONDS = 30

_CHILD = r"""
import json, os, resource, signal, sys, time
import torch
import tdckpt
from tdckpt.errors import TdckptError

def vm_size():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")

limit = vm_size() + (3 << 30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

class CaseTimeout(BaseException):  # not an OSError: nothing in tdckpt may swallow it
    pass

def expire(signum, frame):
    raise CaseTimeout("the case ran past its alarm")

signal.signal(signal.SIGALRM, expire)
for prefix in sys.argv[2:]:
    out = {"name": os.path.basename(prefix)}
    start = time.monotonic()
    signal.alarm(int(sys.argv[1]))
    try:
        report = tdckpt.validate(prefix)
        out["codes"] = [p.code for p in report.errors]
        out["messages"] = [p.message for p in report.errors]
        try:
            tdckpt.load_memmap(prefix, allow_pickle=False, mode="r")
            out["load"] = "ok"
        except TdckptError as exc:
            out["load"] = type(exc).__name__
            out["load_message"] = str(exc)
    except BaseException as exc:  # the test reports it: a crash, a MemoryError, a hang
        out["crash"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        signal.alarm(0)
    out["seconds"] = time.monotonic() - start
    print(json.dumps(out), flush=True)
"""


# -- the hostile prefixes -------------------------------------------------------------------


def _symlink_dag(root: Path, depth: int = 40) -> Path:
    """A real checkpoint beside a chain d0 .. d<depth> where each d_i holds two links to d_i+1
    (2**depth paths to the last one)."""
    prefix = root / "symlink_dag"
    TensorDict({"x": torch.zeros(1)}, batch_size=[]).memmap(prefix)
    for i in range(depth + 1):
        (prefix / f"d{i}").mkdir()
    for i in range(depth):
        for link in ("a", "b"):
            (prefix / f"d{i}" / link).symlink_to(f"../d{i + 1}", target_is_directory=True)
    return prefix


def _g1(root: Path, name: str) -> Path:
    """A tensordict 0.2.1 checkpoint (generation G1: ``meta.pt`` files)."""
    src = copy_case(root / "src" / name, "0.2.1", "flat")
    prefix = root / name
    src.rename(prefix)
    return prefix


def _meta_pt_entries(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as z:
        return [(i.filename, z.read(i.filename)) for i in z.infolist()]


def _pkl_bomb(entries: list[tuple[str, bytes]], inflated: int) -> tuple[bytes, int]:
    """``data.pkl`` followed by ``inflated`` zero bytes (ignored after STOP), deflated."""
    pkl = next(data for name, data in entries if name.endswith("data.pkl"))
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = bytes(1 << 20)
    parts = [comp.compress(pkl)]
    parts += [comp.compress(chunk) for _ in range(inflated >> 20)]
    parts.append(comp.flush())
    return b"".join(parts), zlib.crc32(pkl + bytes((inflated >> 20) << 20))


def _write_zip(
    entries: list[tuple[str, bytes]], replace: str, raw: bytes, size: int, crc: int
) -> bytes:
    """A zip of ``entries`` (stored) whose entry ``replace`` is the deflate stream ``raw``,
    declaring ``size`` and ``crc`` (headers written by hand: zipfile cannot lie)."""
    out = bytearray()
    central = bytearray()
    for name, data in entries:
        fname = name.encode()
        if name == replace:
            method, payload, usize, ucrc = 8, raw, size, crc
        else:
            method, payload, usize, ucrc = 0, data, len(data), zlib.crc32(data)
        offset = len(out)
        out += struct.pack(
            "<4sHHHHHIIIHH",
            b"PK\x03\x04",
            20,
            0,
            method,
            0,
            0x21,
            ucrc,
            len(payload),
            usize,
            len(fname),
            0,
        )
        out += fname + payload
        central += struct.pack(
            "<4sHHHHHHIIIHHHHHII",
            b"PK\x01\x02",
            20,
            20,
            0,
            method,
            0,
            0x21,
            ucrc,
            len(payload),
            usize,
            len(fname),
            0,
            0,
            0,
            0,
            0,
            offset,
        )
        central += fname
    n = len(entries)
    eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(central), len(out), 0)
    return bytes(out + central + eocd)


def _meta_pt_bomb(root: Path) -> Path:
    """meta.pt of about 0.25 MB whose data.pkl entry inflates to 256 MiB (1000x)."""
    prefix = _g1(root, "meta_pt_bomb")
    entries = _meta_pt_entries(prefix / "meta.pt")
    raw, crc = _pkl_bomb(entries, 256 << 20)
    pkl_name = next(n for n, _ in entries if n.endswith("data.pkl"))
    pkl_len = len(next(d for n, d in entries if n == pkl_name))
    (prefix / "meta.pt").write_bytes(_write_zip(entries, pkl_name, raw, pkl_len + (256 << 20), crc))
    return prefix


def _meta_pt_shared_refs(root: Path) -> Path:
    """meta.pt of 9 kB whose device is 1000 references to 1000 references ... (10**12 ints)."""
    prefix = _g1(root, "meta_pt_shared_refs")
    value: Any = [0] * 1000
    for _ in range(3):
        value = [value] * 1000
    torch.save({"batch_size": torch.Size([3]), "device": value}, prefix / "meta.pt")
    assert (prefix / "meta.pt").stat().st_size < 16 * 1024
    return prefix


def _g2_huge_batch(root: Path) -> Path:
    """A tensordict 0.3 lazy stack of two NonTensorData whose batch is [3, 10**9]."""
    src = copy_case(root / "src" / "g2", "0.3.2", "non_tensor_json")
    prefix = root / "g2_huge_batch"
    src.rename(prefix)
    (prefix / "ls").mkdir()
    (prefix / "ls" / "meta.json").write_text(json.dumps({"_type": LS, "stack_dim": 0}))
    for i in range(2):
        member = prefix / "ls" / str(i)
        (member / "_tensordict").mkdir(parents=True)
        meta = {"_type": NTD, "data": "x", "_metadata": None, "_is_non_tensor": True}
        (member / "meta.json").write_text(json.dumps(meta))
        inner = {"shape": [3, 10**9], "device": "cpu", "_type": TD}
        (member / "_tensordict" / "meta.json").write_text(json.dumps(inner))
    return prefix


def _json_containers(root: Path) -> Path:
    """A 40 MB meta.json of 13 million empty lists (about 1 GB once parsed)."""
    prefix = root / "json_containers"
    TensorDict({"x": torch.zeros(3)}, batch_size=[3]).memmap(prefix)
    with open(prefix / "meta.json", "w") as fh:
        fh.write('{"x": [')
        fh.write(",".join(["[]"] * 13_000_000))
        fh.write("]}")
    return prefix


def _json_100_mb(root: Path) -> Path:
    """A nested meta.json of 100 MB (sparse: it costs no disk)."""
    prefix = root / "json_100_mb"
    TensorDict({"n": TensorDict({"x": torch.zeros(3)}, [3])}, batch_size=[3]).memmap(prefix)
    with open(prefix / "n" / "meta.json", "r+b") as fh:
        fh.truncate(100 * 1024 * 1024)
    return prefix


CASES: dict[str, Callable[[Path], Path]] = {
    "symlink_dag": _symlink_dag,
    "meta_pt_bomb": _meta_pt_bomb,
    "meta_pt_shared_refs": _meta_pt_shared_refs,
    "g2_huge_batch": _g2_huge_batch,
    "json_containers": _json_containers,
    "json_100_mb": _json_100_mb,
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every hostile case, read in one memory-limited child process."""
    root = tmp_path_factory.mktemp("dos")
    prefixes = [make(root) for make in CASES.values()]
    digests = {p.name: tree_digest(p) for p in prefixes}
    env = subprocess_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS_DIR)])})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(CASE_SECONDS), *map(str, prefixes)],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=CASE_SECONDS * len(prefixes) + 60,
        )
        stdout, why = proc.stdout, f"the child died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired as exc:  # a hang the alarm could not interrupt
        raw = exc.stdout or b""
        stdout, why = raw.decode() if isinstance(raw, bytes) else raw, "the child hung"
    results: dict[str, dict[str, Any]] = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            out = json.loads(line)
            results[out["name"]] = out
    for p in prefixes:
        results.setdefault(p.name, {"name": p.name, "crash": why})
        results[p.name]["unchanged"] = tree_digest(p) == digests[p.name]
    return results


def _outcome(outcomes: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    out = outcomes[name]
    assert "crash" not in out, out["crash"]
    assert out["seconds"] < CASE_SECONDS / 2, out
    assert out["unchanged"], "reading a hostile checkpoint changed it"
    return out


def test_symlinked_directory_dag_is_read_once_per_directory(outcomes: dict[str, Any]) -> None:
    out = _outcome(outcomes, "symlink_dag")
    # The links live in directories no key names: the checkpoint itself is fine.
    assert out["codes"] == [] and out["load"] == "ok"


@pytest.mark.parametrize(
    ("name", "phrase"),
    [
        ("meta_pt_bomb", "declare"),
        ("meta_pt_shared_refs", "shared references"),
    ],
)
def test_meta_pt_budgets(outcomes: dict[str, Any], name: str, phrase: str) -> None:
    out = _outcome(outcomes, name)
    [message] = [
        m for c, m in zip(out["codes"], out["messages"], strict=True) if c == "bad-meta-pt"
    ]
    assert "meta.pt" in message and phrase in message
    assert out["load"] == "ValidationError" and "meta.pt" in out["load_message"]


def test_g2_stack_over_a_huge_batch_is_not_expanded(outcomes: dict[str, Any]) -> None:
    out = _outcome(outcomes, "g2_huge_batch")
    # The stack left un-inlined is also reported as holding non-tensor members.
    assert out["codes"][0] == "too-large" and set(out["codes"]) <= {"too-large", "stack-mismatch"}
    assert "ls/0" in out["messages"][0] and "1000000000" in out["messages"][0]
    assert out["load"] == "ValidationError"


def test_json_with_millions_of_containers_is_refused_before_parsing(
    outcomes: dict[str, Any],
) -> None:
    out = _outcome(outcomes, "json_containers")
    assert out["codes"] == ["bad-json"]
    assert "meta.json" in out["messages"][0] and "arrays and objects" in out["messages"][0]
    assert out["load"] == "ValidationError"


def test_meta_json_of_100_mb_is_refused_on_its_size(outcomes: dict[str, Any]) -> None:
    out = _outcome(outcomes, "json_100_mb")
    assert "bad-json" in out["codes"]
    [message] = [m for c, m in zip(out["codes"], out["messages"], strict=True) if c == "bad-json"]
    assert f"{100 * 1024 * 1024} bytes, more than the {MAX_JSON_BYTES}" in message
    assert out["load"] == "ValidationError"


# -- in-process: where the budgets stop, and what they leave alone -----------------------------


def test_a_key_aliasing_another_directory_is_refused(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    TensorDict(
        {"a": TensorDict({"x": torch.zeros(3)}, [3]), "b": TensorDict({"x": torch.ones(3)}, [3])},
        batch_size=[3],
    ).memmap(prefix)

    shutil.rmtree(prefix / "b")
    (prefix / "b").symlink_to("a", target_is_directory=True)
    report = tdckpt.validate(prefix)
    [problem] = [p for p in report.errors if p.code == "unsafe-path"]
    assert problem.path == "b" and "second path to the directory 'a'" in problem.message
    assert {p.key for p in report.errors} == {(), ("b",)} or {p.key for p in report.errors} == {
        ("b",)
    }
    with pytest.raises(ValidationError):
        tdckpt.load_memmap(prefix)


def test_the_real_path_wins_over_a_link_met_first(tmp_path: Path) -> None:
    # "a" (a link, sorted first) and "z/real" both name one directory: the link is refused.
    prefix = tmp_path / "ckpt"
    TensorDict({"x": torch.zeros(1)}, batch_size=[]).memmap(prefix)
    (prefix / "z" / "real").mkdir(parents=True)
    (prefix / "a").symlink_to("z/real", target_is_directory=True)
    with open_storage(prefix) as storage:
        tree = read_tree(storage)
    assert "real" in tree.dirs["z"].dirs
    assert "a" not in tree.dirs and "second path" in tree.unsafe["a"]


def test_symlink_dag_stays_linear_in_process(tmp_path: Path) -> None:
    prefix = _symlink_dag(tmp_path, depth=10)  # small: 2**10 paths if each were followed
    with open_storage(prefix) as storage:
        tree = read_tree(storage)
    assert sum(1 for _ in tree.walk()) == 12  # the root and d0 .. d10, each once
    assert set(tree.dirs["d0"].unsafe) == {"a", "b"}


def test_entry_budget(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    TensorDict({f"k{i}": torch.zeros(1) for i in range(50)}, batch_size=[]).memmap(prefix)
    with open_storage(prefix) as storage:
        assert len(read_tree(storage, max_entries=51).files) == 50
    with open_storage(prefix) as storage, pytest.raises(MetadataError, match="more than 40 files"):
        read_tree(storage, max_entries=40)


def test_meta_pt_that_lies_about_its_size_inflates_only_what_it_declares(tmp_path: Path) -> None:
    # The entry declares the pickle's own size (and its CRC) but its stream inflates 64 MiB
    # more: only the declared bytes are ever produced, and the checkpoint loads.
    prefix = _g1(tmp_path, "liar")
    entries = _meta_pt_entries(prefix / "meta.pt")
    pkl_name, pkl = next((n, d) for n, d in entries if n.endswith("data.pkl"))
    raw, _ = _pkl_bomb(entries, 64 << 20)
    (prefix / "meta.pt").write_bytes(_write_zip(entries, pkl_name, raw, len(pkl), zlib.crc32(pkl)))
    assert tdckpt.validate(prefix).ok
    with pytest.warns(TdckptWarning, match="tensordict <= 0.2"):
        assert tdckpt.load_memmap(prefix)["f32"].shape == (3, 2)


def test_meta_pt_with_an_odd_compression_method_is_refused(tmp_path: Path) -> None:
    prefix = _g1(tmp_path, "bzip")
    entries = _meta_pt_entries(prefix / "meta.pt")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in entries:
            method = zipfile.ZIP_BZIP2 if name.endswith("data.pkl") else zipfile.ZIP_STORED
            z.writestr(name, data, compress_type=method)
    (prefix / "meta.pt").write_bytes(out.getvalue())
    report = tdckpt.validate(prefix)
    assert any(p.code == "bad-meta-pt" and "method" in p.message for p in report.errors)


def test_deflated_meta_pt_within_budget_still_loads(tmp_path: Path) -> None:
    # torch.save never compresses, but a re-zipped meta.pt of honest size is fine.
    prefix = _g1(tmp_path, "deflated")
    entries = _meta_pt_entries(prefix / "meta.pt")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries:
            z.writestr(name, data)
    (prefix / "meta.pt").write_bytes(out.getvalue())
    assert tdckpt.validate(prefix).ok
    with pytest.warns(TdckptWarning, match="tensordict <= 0.2"):
        assert tdckpt.load_memmap(prefix)["i64"].shape == (3,)


def test_meta_pt_nested_too_deep_is_refused(tmp_path: Path) -> None:
    prefix = _g1(tmp_path, "deep")
    value: Any = 0
    for _ in range(40):
        value = [value]
    torch.save({"batch_size": torch.Size([3]), "device": value}, prefix / "meta.pt")
    report = tdckpt.validate(prefix)
    assert any(p.code == "bad-meta-pt" and "deep" in p.message for p in report.errors)


def test_g2_stack_within_the_budget_is_inlined(tmp_path: Path) -> None:
    prefix = _g2_huge_batch(tmp_path)
    (prefix / "ls" / "meta.json").write_text(json.dumps({"_type": LS, "stack_dim": 1}))
    for i in range(2):
        inner = prefix / "ls" / str(i) / "_tensordict" / "meta.json"
        inner.write_text(json.dumps({"shape": [3, 4], "device": "cpu", "_type": TD}))
    # its list values may have been tuples: an info of validate, no longer a restore warning
    out = tdckpt.load_memmap(prefix)
    assert out.get("ls").batch_size == (3, 2, 4)
    assert out.get("ls").tolist()[1][0] == ["x"] * 4


def test_g1_batch_of_thousands_of_dims_is_not_a_size(tmp_path: Path) -> None:
    # A lazy stack nested in a G1 tensordict is recognised by comparing batch sizes one
    # dimension at a time, each with a copy: quadratic in the number of dimensions.
    prefix = _g1(tmp_path, "dims")
    dims = 20_000
    for stale in prefix.glob("*.meta.pt"):
        stale.unlink()
    for stale in prefix.glob("*.memmap"):
        stale.unlink()
    torch.save({"batch_size": torch.Size([1] * dims), "device": None}, prefix / "meta.pt")
    (prefix / "0").mkdir()
    torch.save(
        {"batch_size": torch.Size([1] * (dims - 1)), "device": None}, prefix / "0" / "meta.pt"
    )
    report = tdckpt.validate(prefix)
    bad = [p for p in report.errors if p.code == "bad-meta-pt"]
    assert bad and all("no batch size" in p.message for p in bad)
    assert {p.code for p in report.errors} <= {"bad-meta-pt", "missing-meta"}


def _archive(tmp_path: Path) -> Path:
    prefix = tmp_path / "ckpt"
    TensorDict({"x": torch.zeros(3)}, batch_size=[3]).memmap(prefix)
    archive = tmp_path / "ckpt.tdz"
    with zipfile.ZipFile(archive, "w") as z:
        for f in sorted(prefix.iterdir()):
            z.write(f, f.name)
    return archive


def test_archive_declaring_millions_of_entries_is_refused_before_parsing(tmp_path: Path) -> None:
    # The zip64 end record counts entries in 64 bits: it declares 5 million here (an honest
    # one would take 300 MB of central directory, and minutes and gigabytes to index).
    archive = _archive(tmp_path)
    assert tdckpt.validate(archive).ok
    data = archive.read_bytes()
    end = data.rindex(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<II", data, end + 12)
    zip64_end = struct.pack(
        "<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, 5_000_000, 5_000_000, cd_size, cd_offset
    )
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, end, 1)
    eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    archive.write_bytes(bytes(data[:end]) + zip64_end + locator + eocd)
    report = tdckpt.validate(archive)
    [problem] = report.errors
    assert "5000000 entries" in problem.message and str(archive) in problem.message
    with pytest.raises(MetadataError, match="5000000 entries"):
        tdckpt.load_memmap(archive)


@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_one_metadata_file_linked_into_many_directories_is_budgeted(
    tmp_path: Path, link: str
) -> None:
    # 40 directories share one 1 MB meta.json: 1 MB on disk, 40 MB to parse. Over the
    # (here lowered) total budget the read stops with an error naming where.
    prefix = tmp_path / "ckpt"
    TensorDict({"x": torch.zeros(3)}, batch_size=[3]).memmap(prefix)
    big = prefix / "shared.json"
    big.write_text(json.dumps({"pad": "x" * 1_000_000}))
    for i in range(40):
        (prefix / f"d{i}").mkdir()
        if link == "hard":
            os.link(big, prefix / f"d{i}" / "meta.json")
        else:
            (prefix / f"d{i}" / "meta.json").symlink_to("../shared.json")
    with open_storage(prefix) as storage:
        assert len(read_tree(storage, max_metadata_bytes=50_000_000).dirs) == 40
    with (
        open_storage(prefix) as storage,
        pytest.raises(MetadataError, match="more than 20000000 bytes together") as info,
    ):
        read_tree(storage, max_metadata_bytes=20_000_000)
    assert "meta.json" in str(info.value)


def test_a_bind_mount_of_the_prefix_inside_itself_is_read_once(tmp_path: Path) -> None:
    # No symlink: only the prefix's own identity (asked once it has sub-directories) tells
    # that n/m is the prefix again. Without it, the whole tree would be read a second time.
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a bind mount needs root")
    prefix = tmp_path / "ckpt"
    TensorDict({"a": torch.zeros(3), "n": TensorDict({"x": torch.ones(3)}, [3])}, [3]).memmap(
        prefix
    )
    (prefix / "n" / "m").mkdir()
    done = subprocess.run(
        ["mount", "--bind", str(prefix), str(prefix / "n" / "m")], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr!r}")
    try:
        with open_storage(prefix) as storage:
            tree = read_tree(storage)
        assert "m" not in tree.dirs["n"].dirs
        assert "second path to the directory '.'" in tree.dirs["n"].unsafe["m"]
        report = tdckpt.validate(prefix)
        assert [p.path for p in report.errors if p.code == "unsafe-path"] == ["n/m"]
    finally:
        subprocess.run(["umount", str(prefix / "n" / "m")], check=True)
