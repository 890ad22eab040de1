"""tdckpt benchmarks: one command, every ratio measured against its baseline in the same run.

    python benchmarks/run.py [restore|restore_into|save|verify|upgrade|selective|incremental ...]
        [--quick]

* restore: ``tdckpt.load_memmap_`` vs tensordict's ``td.load_memmap_`` on the same
  checkpoints (10, 1,000 and 10,000 leaves; one 1 GiB leaf vs one 1 KiB leaf), and
  restore_into; for 10,000 leaves, tdckpt's time per leaf against the syscall floor measured
  in the same run (an open/fstat/mmap/close loop over the same files).
  Also a 10,000-leaf consolidated file (``td.consolidate(filename=...)``) restored in place,
  vs ``td.load_memmap_`` of the per-leaf layout and vs ``TensorDict.from_consolidated``.
* restore_into: ``CheckpointManager.restore_into`` (strict) vs tensordict's ``td.load_memmap_``
  on the same committed step of 10,000 leaves, ``tdckpt.load_memmap_`` of it beside them.
* save: ``CheckpointManager.save`` (checksums + fsync) vs ``td.memmap(prefix)``.
* verify: ``CheckpointManager.verify`` vs ``sha256sum`` over the same files.
* remote: object storage, ``CheckpointManager("s3://...")`` save / restore_into vs DCP's
  FsspecWriter / FsspecReader on one local moto server, requests counted
  (benchmarks/bench_remote.py).
* selective: restoring 1% of the leaves of a 1 GiB step vs the whole step, on a local root
  and on a moto S3 server (requests and bytes counted), and ``tdckpt.export_safetensors``
  vs ``safetensors.torch.save_file`` of the same tensors (benchmarks/bench_selective.py).
* torchrl: a 1M-transition ``LazyMemmapStorage`` buffer and a policy through
  ``torchrl.checkpoint``, TorchRL's default adapters (+ fsync) vs tdckpt's
  (benchmarks/bench_torchrl.py; needs torchrl).
* incremental: a 1 GiB state with 1% changed saved incrementally vs in full (time), the
  root's growth vs the changed bytes (``du``), and the restore of an incremental step vs a
  full one (benchmarks/bench_incremental.py).
* upgrade: ``tdckpt upgrade`` of a legacy (tensordict 0.12-layout) checkpoint with a 1 GiB
  leaf vs one with a 1 KiB leaf, without a backup (leaves hard-linked, read once for their
  checksum) and with one (leaves copied - or reflinked where the file system can - so that
  the backup shares no file with the upgraded tree).

Each timing is the best of several runs; ratios < 1 mean tdckpt is faster. Nothing here
asserts: the numbers are for people (and for the changelog), not for the test suite.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# Time this checkout's tdckpt, installed or not (``python benchmarks/run.py`` from anywhere).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 1024**3


def best_of(func: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> float:
    """Best wall time of ``reps`` runs of ``func(setup())``, GC collected between runs."""
    best = float("inf")
    for _ in range(reps):
        arg = setup() if setup is not None else None
        gc.collect()
        start = time.perf_counter()
        func(arg) if setup is not None else func()  # type: ignore[call-arg]
        best = min(best, time.perf_counter() - start)
    return best


def row(label: str, base: float, ours: float, base_name: str) -> None:
    print(
        f"  {label:<28} {base_name} {base * 1e3:10.3f} ms   "
        f"tdckpt {ours * 1e3:10.3f} ms   ratio {ours / base:5.2f}"
    )


def _flat_td(n: int) -> Any:
    from tensordict import TensorDict

    return TensorDict({f"k{i}": torch.randn(4) for i in range(n)}, batch_size=[4])


def head_to_head(
    base: Callable[[Any], Any],
    ours: Callable[[Any], Any],
    reps: int,
    setup: Callable[[], Any],
    *,
    cold: bool,
) -> tuple[float, float]:
    """Best times of ``base(setup())`` and ``ours(setup())``, run in alternation.

    Alternating (and swapping which goes first) keeps drift of the machine out of the
    ratio. ``cold``: a full garbage collection before every run, as a one-off restore in
    a long-running training process meets it (caches flushed by the collector's pass
    over every object). Otherwise warm: back-to-back restores with the collector paused,
    as ``timeit`` measures.
    """
    best = {"base": float("inf"), "ours": float("inf")}
    enabled = gc.isenabled()
    if not cold:
        gc.collect()
        gc.disable()
    try:
        for rep in range(reps):
            order = (
                (("base", base), ("ours", ours))
                if rep % 2 == 0
                else (("ours", ours), ("base", base))
            )
            for name, func in order:
                arg = setup()
                if cold:
                    gc.collect()
                start = time.perf_counter()
                func(arg)
                best[name] = min(best[name], time.perf_counter() - start)
    finally:
        if enabled:
            gc.enable()
    return best["base"], best["ours"]


def bench_restore(work: Path, quick: bool) -> None:
    from tensordict import TensorDict

    import tdckpt

    print(
        "restore: tdckpt.load_memmap_ vs tensordict td.load_memmap_ (same checkpoint, fresh target)"
    )
    print("  cold: garbage collected before each run (a one-off restore); warm: back to back")
    sizes = (10, 1000) if quick else (10, 1000, 10000)
    for n in sizes:
        prefix = work / f"flat{n}"
        _flat_td(n).memmap(prefix)
        reps = 41 if n <= 10 else 9 if n <= 1000 else 7

        def target(n: int = n) -> Any:
            return TensorDict({f"k{i}": torch.zeros(4) for i in range(n)}, batch_size=[4])

        for cold in (True, False):
            base, ours = head_to_head(
                lambda t, prefix=prefix: t.load_memmap_(prefix),
                lambda t, prefix=prefix: tdckpt.load_memmap_(t, prefix),
                reps,
                target,
                cold=cold,
            )
            row(f"{n} leaves ({'cold' if cold else 'warm'})", base, ours, "tensordict")
        if n == sizes[-1]:
            _stage_breakdown(prefix, target, base)
            _syscall_floor(prefix, n, ours)
    bench_restore_into(work, quick)
    bench_consolidated(work, quick)
    big = 64 * 1024**2 if quick else GiB
    results = {}
    for label, nbytes in (("1 KiB leaf", 1024), (f"{big // 1024**2} MiB leaf", big)):
        prefix = work / f"one{nbytes}"
        TensorDict(x=torch.empty(nbytes, dtype=torch.uint8)).memmap(prefix)
        for cold in (True, False):
            base, ours = head_to_head(
                lambda t, prefix=prefix: t.load_memmap_(prefix),
                lambda t, prefix=prefix: tdckpt.load_memmap_(t, prefix),
                41,
                lambda: TensorDict(x=torch.zeros(1)),
                cold=cold,
            )
            if cold:
                results[label] = ours
            row(f"{label} ({'cold' if cold else 'warm'})", base, ours, "tensordict")
            if cold and nbytes == 1024:
                _stage_breakdown(prefix, lambda: TensorDict(x=torch.zeros(1)), base, reps=41)
        shutil.rmtree(prefix)
    small, large = results.values()
    print(
        f"  big leaf / small leaf restore time (cold): {large / small:.2f} "
        "(metadata-only restore: ~1)"
    )


def _syscall_floor(prefix: Path, n: int, ours: float, reps: int = 7) -> None:
    """The per-leaf layout's time per leaf against the machine's syscall floor, measured in
    the same run: open, fstat, mmap and close of each leaf file of ``prefix`` (what mapping
    a leaf needs at the least), best of ``reps``; ``ours``: tdckpt's best restore time."""
    import ctypes
    import mmap as mmap_mod

    libc = ctypes.CDLL(None, use_errno=True)
    do_mmap, do_munmap = libc.mmap, libc.munmap
    do_mmap.restype = ctypes.c_void_p
    do_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    do_mmap.argtypes += [ctypes.c_int, ctypes.c_int64]
    do_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    files = sorted(str(p) for p in prefix.glob("*.memmap"))
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    prot = mmap_mod.PROT_READ | mmap_mod.PROT_WRITE
    best = float("inf")
    for _ in range(reps):
        maps: list[tuple[int, int]] = []
        start = time.perf_counter()
        for path in files:
            fd = os.open(path, flags)
            size = os.fstat(fd).st_size
            maps.append((do_mmap(None, size, prot, mmap_mod.MAP_PRIVATE, fd, 0), size))
            os.close(fd)
        best = min(best, time.perf_counter() - start)
        for addr, size in maps:
            do_munmap(addr, size)
    per_leaf, floor = ours / n, best / len(files)
    print(
        f"    per leaf: tdckpt {per_leaf * 1e6:.2f} us, syscall floor (open+fstat+mmap+close) "
        f"{floor * 1e6:.2f} us, ratio {per_leaf / floor:.2f} (target <= 1.3)"
    )


def _stage_breakdown(prefix: Path, target: Callable[[], Any], base: float, reps: int = 3) -> None:
    """Where one ``tdckpt.load_memmap_`` spends its time, per stage, as fractions of
    tensordict's best time ``base`` (best of ``reps``; the stages' functions timed in place).

    A tree in the exact current form is read by the current-form lane (``_read/lane.py``:
    list + read metadata, then validate); any other by the general read (read metadata,
    names, validate, other open checks). Both then map, assemble and commit.
    """
    import tdckpt
    from tdckpt._read import lane, pipeline
    from tdckpt._restore import engine, reading

    stages = {
        "lane": (reading, "open_current"),
        "lane validate": (lane, "build_nodes"),
        "read": (pipeline, "read_tree"),
        "names": (pipeline, "normalize_names"),
        "validate": (pipeline, "build_nodes"),
        "open": (reading, "open_for_restore"),
        "map+commit": (engine, "restore_into_target"),
    }
    spent: dict[str, float] = {}
    saved = {name: getattr(mod, attr) for name, (mod, attr) in stages.items()}

    def timed(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

        return run

    best: dict[str, float] = {}
    try:
        for name, (mod, attr) in stages.items():
            setattr(mod, attr, timed(name, saved[name]))
        for _ in range(reps):
            spent.clear()
            t = target()
            gc.collect()
            start = time.perf_counter()
            tdckpt.load_memmap_(t, prefix)
            spent["total"] = time.perf_counter() - start
            for name in stages:
                spent.setdefault(name, 0.0)
            for name, value in spent.items():
                best[name] = min(best.get(name, float("inf")), value)
    finally:
        for name, (mod, attr) in stages.items():
            setattr(mod, attr, saved[name])
    if best["open"] == 0.0:  # the lane read it
        parts = [
            ("lane: list + read metadata", best["lane"] - best["lane validate"]),
            ("validate", best["lane validate"]),
        ]
        opened = best["lane"]
    else:
        other_open = best["open"] - best["read"] - best["names"] - best["validate"]
        parts = [
            ("read metadata", best["read"]),
            ("names", best["names"]),
            ("validate", best["validate"]),
            ("other checks", other_open),
        ]
        opened = best["open"] + best["lane"]  # a lane that declined costs its try
    rest = best["total"] - opened - best["map+commit"]
    parts += [("map+assemble+commit", best["map+commit"]), ("rest (frees)", rest)]
    print(
        "    stages, x tensordict's time: "
        + ", ".join(f"{label} {value / base:.3f}" for label, value in parts)
        + f" (total {best['total'] / base:.3f})"
    )


def bench_restore_into(work: Path, quick: bool) -> None:
    """``CheckpointManager.restore_into`` (strict, the default) vs tensordict's ``load_memmap_``
    on the same committed step; ``tdckpt.load_memmap_`` of that step beside it."""
    from tensordict import TensorDict

    import tdckpt

    n = 1000 if quick else 10000
    mgr = tdckpt.CheckpointManager(work / "managed", fsync=False)
    mgr.save(1, _flat_td(n))
    step = mgr.path(1)

    def target() -> Any:
        return TensorDict({f"k{i}": torch.zeros(4) for i in range(n)}, batch_size=[4])

    print(f"restore_into: CheckpointManager.restore_into (strict) vs td.load_memmap_, {n} leaves")

    def theirs(t: Any) -> None:
        t.load_memmap_(step)

    def managed(t: Any) -> None:
        mgr.restore_into(t, allow_pickle=False)

    def plain(t: Any) -> None:
        tdckpt.load_memmap_(t, step, allow_pickle=False)

    for cold in (True, False):
        when = "cold" if cold else "warm"
        base, ours = head_to_head(theirs, managed, 7, target, cold=cold)
        row(f"restore_into ({when})", base, ours, "tensordict")
        base, ours = head_to_head(theirs, plain, 7, target, cold=cold)
        row(f"tdckpt.load_memmap_ ({when})", base, ours, "tensordict")
    shutil.rmtree(work / "managed")


def bench_consolidated(work: Path, quick: bool) -> None:
    """A 10,000-leaf step in the consolidated layout restored in place - by
    ``CheckpointManager.restore_into`` (a step saved with ``layout="consolidated"``) and by
    ``tdckpt.load_memmap_`` of the bare file ``td.consolidate(filename=...)`` wrote - against
    tensordict's ``load_memmap_`` of the same data in the per-leaf layout (target ratio
    <= 0.10) and tensordict's ``from_consolidated`` of the same file (target <= 0.5):
    absolute times beside the ratios."""
    from tensordict import TensorDict

    import tdckpt

    n = 1000 if quick else 10000
    data = _flat_td(n)
    per_leaf = work / f"consolidated-per-leaf{n}"
    data.memmap(per_leaf)
    one_file = work / f"consolidated{n}.bin"
    data.consolidate(filename=one_file)
    mgr = tdckpt.CheckpointManager(work / "consolidated-run", fsync=False, layout="consolidated")
    step_file = mgr.save(1, data) / "tensordict.consolidated"

    def target() -> Any:
        return TensorDict({f"k{i}": torch.zeros(4) for i in range(n)}, batch_size=[4])

    print(f"consolidated: {n} leaves in one file, restored in place")

    def restore_into(t: Any) -> None:
        mgr.restore_into(t, allow_pickle=False)

    def load_file(t: Any) -> None:
        tdckpt.load_memmap_(t, one_file, allow_pickle=False)

    for cold in (True, False):
        when = "cold" if cold else "warm"
        for label, ours, source in (
            ("restore_into", restore_into, step_file),
            ("load_memmap_ of the file", load_file, one_file),
        ):
            base, mine = head_to_head(
                lambda t: t.load_memmap_(per_leaf), ours, 7, target, cold=cold
            )
            row(f"{label} vs per-leaf ({when})", base, mine, "td.load_memmap_")
            base, mine = head_to_head(
                lambda t, source=source: TensorDict.from_consolidated(source),
                ours,
                7,
                target,
                cold=cold,
            )
            row(f"{label} vs file ({when})", base, mine, "from_consolidated")
    mgr.close()
    shutil.rmtree(per_leaf)
    shutil.rmtree(work / "consolidated-run")
    one_file.unlink()


def bench_save(work: Path, quick: bool) -> None:
    from tensordict import TensorDict

    from tdckpt import CheckpointManager

    print(
        "save: CheckpointManager.save (checksums while writing, atomic commit) vs td.memmap(prefix)"
    )
    print(
        "      fsync=False has td.memmap's durability (page cache); "
        "fsync=True (the default) waits for the disk"
    )
    total = 256 * 1024**2 if quick else GiB
    for n in (4, 1000):
        per = total // n // 4
        td = TensorDict({f"k{i}": torch.randn(per) for i in range(n)})
        counter = iter(range(1_000_000))

        def base(td: TensorDict = td, counter: Iterator[int] = counter) -> None:
            td.memmap(work / f"tdsave{next(counter)}")

        def ours(
            fsync: bool, td: TensorDict = td, counter: Iterator[int] = counter, n: int = n
        ) -> None:
            with CheckpointManager(work / f"mgr{n}-{fsync}", fsync=fsync) as mgr:
                mgr.save(next(counter), td)

        # Each run starts with no dirty pages left by the previous one (writeback of old
        # runs would otherwise throttle whichever writer comes next).
        def clean() -> None:
            for p in work.iterdir():
                shutil.rmtree(p)
            os.sync()

        base_t = best_of(lambda _: base(), 3, clean)
        fast_t = best_of(lambda _: ours(False), 3, clean)
        durable_t = best_of(lambda _: ours(True), 3, clean)
        mb = total / 1024**2
        print(
            f"  {n:>4} leaves, {mb:.0f} MiB: td.memmap {mb / base_t:6.0f} MiB/s | "
            f"tdckpt fsync=False {mb / fast_t:6.0f} MiB/s (ratio {base_t / fast_t:4.2f}) | "
            f"fsync=True {mb / durable_t:6.0f} MiB/s (ratio {base_t / durable_t:4.2f})"
        )
        clean()


def bench_verify(work: Path, quick: bool) -> None:
    from tensordict import TensorDict

    from tdckpt import CheckpointManager

    print("verify: CheckpointManager.verify vs sha256sum of the same files")
    total = 256 * 1024**2 if quick else GiB
    td = TensorDict({f"k{i}": torch.randn(total // 16 // 4) for i in range(16)})
    mb = total / 1024**2
    for checksum in ("crc32", "sha256"):
        root = work / f"verify-{checksum}"
        with CheckpointManager(root, checksum=checksum, fsync=False) as mgr:
            path = mgr.save(1, td)
        files = [str(p) for p in Path(path).rglob("*") if p.is_file()]
        base = best_of(
            lambda files=files: subprocess.run(
                ["sha256sum", *files], check=True, capture_output=True
            ),
            3,
        )
        ours = best_of(lambda root=root: CheckpointManager(root).verify(1), 3)
        print(
            f"  {mb:.0f} MiB in 16 files, {checksum} manifest: sha256sum {mb / base:6.0f} MiB/s   "
            f"tdckpt verify {mb / ours:6.0f} MiB/s   throughput ratio {base / ours:5.2f}"
        )
        shutil.rmtree(root)


def _legacy_checkpoint(prefix: Path, nbytes: int, *, fill: bool = False) -> None:
    """A tensordict 0.12-layout checkpoint (compact JSON, no format version, raw names).

    ``fill``: real bytes on disk (a sparse file would make a copy look cheaper than it is).
    """
    prefix.mkdir(parents=True)
    data = prefix / "big leaf.memmap"
    with open(data, "wb") as fh:
        if fill:
            chunk = os.urandom(1 << 20)
            for _ in range(nbytes >> 20):
                fh.write(chunk)
            fh.write(chunk[: nbytes & ((1 << 20) - 1)])
        else:
            fh.truncate(nbytes)
    meta = {
        "big leaf": {
            "device": "cpu",
            "shape": [nbytes],
            "dtype": "torch.uint8",
            "is_nested": False,
        },
        "shape": [],
        "device": "cpu",
        "_type": "<class 'tensordict._td.TensorDict'>",
    }
    (prefix / "meta.json").write_text(json.dumps(meta, separators=(",", ":")))


def bench_upgrade(work: Path, quick: bool) -> None:
    from tdckpt import upgrade

    print("upgrade: tdckpt upgrade of a legacy checkpoint, 1 GiB leaf vs 1 KiB leaf")
    big = 64 * 1024**2 if quick else GiB
    for keep in (False, True):
        mode = (
            "backup=True (leaves copied or reflinked)"
            if keep
            else "backup=False (leaves hard-linked)"
        )
        print(f"  {mode}; every leaf checksummed")
        times = {}
        for label, nbytes in (("1 KiB leaf", 1024), (f"{big // 1024**2} MiB leaf", big)):
            counter = iter(range(1000))

            def setup(
                nbytes: int = nbytes, keep: bool = keep, counter: Iterator[int] = counter
            ) -> Path:
                prefix = work / f"legacy{nbytes}-{int(keep)}-{next(counter)}"
                _legacy_checkpoint(prefix, nbytes, fill=True)
                os.sync()  # the upgrade's own fsyncs should not flush the setup's writes
                return prefix

            def run(p: Path, keep: bool = keep) -> None:
                report = upgrade(p, backup=keep)
                if keep:
                    shutil.rmtree(report.backup)  # type: ignore[arg-type]

            times[label] = best_of(run, 7 if not keep else 5, setup)
            print(f"    {label:<14} {times[label] * 1e3:9.2f} ms")
            for leftover in work.glob("legacy*"):
                shutil.rmtree(leftover)
        small, large = times.values()
        mib_s = (big / 1024**2) / max(large - small, 1e-9)
        print(f"    ratio big/small: {large / small:.2f}; leaf data at {mib_s:.0f} MiB/s")
        if keep:  # the floor of any honest copy: the same bytes through cp + fsync
            src = work / "legacy-floor"
            _legacy_checkpoint(src, big, fill=True)
            os.sync()

            def floor(_: Any, src: Path = src) -> None:
                dst = work / "legacy-floor-copy.memmap"
                shutil.copyfile(src / "big leaf.memmap", dst)
                fd = os.open(dst, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                dst.unlink()

            base = best_of(floor, 5, lambda: None)
            print(
                f"    baseline: shutil.copyfile + fsync of the same leaf {base * 1e3:9.2f} ms "
                f"(upgrade/baseline {large / base:.2f})"
            )
            shutil.rmtree(src)


BENCHES = {
    "restore": bench_restore,
    "restore_into": bench_restore_into,  # also part of "restore"; alone, for a quick look
    "consolidated": bench_consolidated,  # also part of "restore"
    "save": bench_save,
    "verify": bench_verify,
    "upgrade": bench_upgrade,
    "distributed": lambda work, quick: __import__("bench_distributed").bench(work, quick),
    "async": lambda work, quick: __import__("bench_async").bench(work, quick),
    "state": lambda work, quick: __import__("bench_state").bench(work, quick),
    "remote": lambda work, quick: __import__("bench_remote").bench(work, quick),
    "selective": lambda work, quick: __import__("bench_selective").bench(work, quick),
    "torchrl": lambda work, quick: __import__("bench_torchrl").bench(work, quick),
    "incremental": lambda work, quick: __import__("bench_incremental").bench(work, quick),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "which", nargs="*", metavar="BENCH", help=f"any of {', '.join(BENCHES)} (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = parser.parse_args()
    unknown = [w for w in args.which if w not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="tdckpt-bench-") as tmp:
        skipped = ("restore_into", "consolidated", "torchrl")  # by name only
        for name in args.which or [b for b in BENCHES if b not in skipped]:
            BENCHES[name](Path(tmp), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
