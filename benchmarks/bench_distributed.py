"""Sharded save, load and 2 -> 3 reshard: tdckpt's collective manager vs DCP.

    python benchmarks/run.py distributed [--quick]

Two ranks (gloo on 127.0.0.1, forkserver children) save the same data both ways - tdckpt:
``CheckpointManager.save(step, shard)`` (checksums + fsync); DCP: ``dcp.save`` of a state dict
of DTensors sharded along dim 0 (``Shard(0)``, fsync on) - and load it back on the same two
ranks; then three ranks load what two saved (a 2 -> 3 reshard). Datasets: 5,000 leaves x 64
floats and 4 leaves x 64 MiB (float32 ``[65536, 256]``).

Timings: best of a few runs, the slowest rank's wall time between two barriers; each save
starts after an untimed ``os.sync()``, so none pays for an earlier one's writeback. "load" for
tdckpt is ``restore()`` (mapped, zero-copy views of the rows); "load+read" also copies every
restored byte (``clone()``), so it pays for reading what DCP's load reads; DCP's load reads
into preallocated tensors.

Read amplification (bytes read / bytes needed, summed over the ranks) of the 2 -> 3
reshard: for tdckpt the bytes of the rows its reader slices out of the mapped shards
(``tdckpt._shard.rows.ReadStats.bytes_requested``: only those pages are touched); for DCP
the bytes its ``FileSystemReader`` reads per request (``_slice_file`` of each saved item,
which it loads whole - a ``torch.save`` container per item - and then narrows), counted by
a subclass of the reader. Needed bytes:
each rank's part of the global rows (``torch.tensor_split`` for tdckpt; DTensor's
``Shard(0)`` split for DCP). Page-cache reads are not measured (cold caches need root).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

MiB = 1 << 20


def _data(name: str, quick: bool) -> dict[str, tuple[int, ...]]:
    """key -> global shape (dim 0 is the sharded batch dim)."""
    if name == "small":
        n = 500 if quick else 5000
        return {f"k{i}": (64,) for i in range(n)}
    rows = 4096 if quick else 65536  # x 256 float32 = 4 MiB / 64 MiB
    return {f"big{i}": (rows, 256) for i in range(4)}


def _global(name: str, quick: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(*shape, generator=g) for k, shape in _data(name, quick).items()}


def _timed(fn: Any, reps: int, *, settle: bool = False) -> float:
    """Best of ``reps``: the slowest rank's wall time of ``fn`` between two barriers.

    ``settle`` (the saves): rank 0 runs ``os.sync()`` first, untimed, so that no save pays
    for the writeback of an earlier one (without it the 5,000-leaf save measured about 1.5 s
    or about 2.4 s at random, whatever the code).
    """
    import torch.distributed as dist

    best = float("inf")
    for _ in range(reps):
        if settle and dist.get_rank() == 0:
            os.sync()
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, float(elapsed))
    return best


def _same(name: str, rank: int, world: int, mesh: Any, work: Path, quick: bool) -> dict[str, Any]:
    """Save and load ``name`` on the same ranks, both ways; the timings."""
    import torch.distributed.checkpoint as dcp
    from tensordict import TensorDict
    from torch.distributed.tensor import Shard, distribute_tensor

    from tdckpt import CheckpointManager
    from tdckpt._shard.rows import even_part

    reps = 1 if quick else 3
    whole = _global(name, quick)
    rows = next(iter(whole.values())).shape[0]
    dcp_dir = work / f"dcp-{name}"
    start, stop = even_part(rows, rank, world)
    shard = TensorDict({k: v[start:stop] for k, v in whole.items()}, batch_size=[stop - start])
    mgr = CheckpointManager(work / f"ours-{name}", timeout=600)
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in whole.items()}
    target = {k: distribute_tensor(torch.empty_like(v), mesh, [Shard(0)]) for k, v in whole.items()}
    runs = {"ours": 0, "dcp": 0}

    def ours_save() -> None:
        runs["ours"] += 1
        mgr.save(runs["ours"], shard)

    def dcp_save() -> None:
        runs["dcp"] += 1
        dcp.save(sd, checkpoint_id=str(dcp_dir / str(runs["dcp"])))

    out: dict[str, Any] = {}
    out[f"{name} save"] = (
        _timed(dcp_save, reps, settle=True),
        _timed(ours_save, reps, settle=True),
    )
    dcp_time = _timed(lambda: dcp.load(target, checkpoint_id=str(dcp_dir / str(runs["dcp"]))), reps)
    out[f"{name} load"] = (dcp_time, _timed(lambda: mgr.restore(runs["ours"]), reps))
    out[f"{name} load+read"] = (
        dcp_time,
        _timed(lambda: mgr.restore(runs["ours"]).clone(), reps),
    )
    got = mgr.restore(runs["ours"])
    assert all(torch.equal(got[k], whole[k][start:stop]) for k in list(whole)[:5])
    assert all(torch.equal(target[k].to_local(), got[k]) for k in list(whole)[:5])
    if rank == 0:
        (work / f"{name}.last").write_text(json.dumps([runs["ours"], runs["dcp"]]))
    mgr.close()
    return out


def _reshard(name: str, rank: int, world: int, mesh: Any, work: Path, quick: bool) -> list[float]:
    """Three ranks read what two saved: bytes read and needed, both ways, summed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from tdckpt import CheckpointManager
    from tdckpt._shard.restore import restore_rows
    from tdckpt._shard.rows import ReadStats, even_part

    whole = _global(name, quick)
    rows = next(iter(whole.values())).shape[0]
    last_ours, last_dcp = json.loads((work / f"{name}.last").read_text())
    mgr = CheckpointManager(work / f"ours-{name}", timeout=600)
    stats = ReadStats()
    part = restore_rows(
        mgr._shard_steps(), last_ours, None, allow_pickle=False, mode="r", verify=False, stats=stats
    )
    start, stop = even_part(rows, rank, world)
    assert all(torch.equal(part[k], whole[k][start:stop]) for k in list(whole)[:5])
    needed = sum(part[k].numel() * part[k].element_size() for k in whole)

    class CountingReader(FileSystemReader):
        read = 0

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            CountingReader.read += int(sinfo.length)
            return super()._slice_file(file, sinfo)

    target = {k: distribute_tensor(torch.empty_like(v), mesh, [Shard(0)]) for k, v in whole.items()}
    dcp.load(target, storage_reader=CountingReader(str(work / f"dcp-{name}" / str(last_dcp))))
    assert all(isinstance(target[k], DTensor) for k in whole)
    dcp_needed = sum(target[k].to_local().numel() * 4 for k in whole)
    totals = torch.tensor(
        [stats.bytes_requested, needed, CountingReader.read, dcp_needed], dtype=torch.float64
    )
    dist.all_reduce(totals)
    mgr.close()
    return [float(x) for x in totals.tolist()]


def _worker(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    work, quick = Path(job["work"]), job["quick"]
    out: dict[str, Any] = {}
    for name in ("small", "big"):
        if job["phase"] == "same":
            out.update(_same(name, rank, world, mesh, work, quick))
        else:
            out[f"{name} reshard"] = _reshard(name, rank, world, mesh, work, quick)
    if rank == 0:
        (work / f"result-{job['phase']}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(world: int, job: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, job)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"benchmark ranks failed with exit codes {bad}")
    return json.loads((Path(job["work"]) / f"result-{job['phase']}.json").read_text())


def bench(work: Path, quick: bool) -> None:
    """2-rank save/load vs DCP, and the 2 -> 3 reshard's read amplification."""
    work = work / "distributed"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    same = _run(2, {"phase": "same", "work": str(work), "quick": quick})
    reshard = _run(3, {"phase": "reshard", "work": str(work), "quick": quick})
    sizes = {"small": "5,000 leaves x 64 floats", "big": "4 leaves x 64 MiB"}
    if quick:
        sizes = {"small": "500 leaves x 64 floats", "big": "4 leaves x 4 MiB"}
    print("distributed: 2 ranks, tdckpt CheckpointManager vs torch.distributed.checkpoint (DCP)")
    for name in ("small", "big"):
        print(f"  {sizes[name]}")
        for what in ("save", "load", "load+read"):
            base, ours = same[f"{name} {what}"]
            print(
                f"    {what:<10} DCP {base * 1e3:10.1f} ms   tdckpt {ours * 1e3:10.1f} ms   "
                f"ratio {ours / base:5.2f}"
            )
        ours_read, ours_needed, dcp_read, dcp_needed = reshard[f"{name} reshard"]
        print(
            f"    2 -> 3 reshard read amplification: DCP {dcp_read / dcp_needed:.2f} "
            f"({dcp_read / MiB:.1f} of {dcp_needed / MiB:.1f} MiB)   tdckpt "
            f"{ours_read / ours_needed:.2f} ({ours_read / MiB:.1f} of {ours_needed / MiB:.1f} MiB)"
        )


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tdckpt-bench-") as tmp:
        bench(Path(tmp), "--quick" in sys.argv)
