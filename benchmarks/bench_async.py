"""async: how long ``save_async`` blocks the training loop, and whether memory stays flat.

    python benchmarks/run.py async [--quick]

* Main-thread blocking time on one 256 MiB state (32 MiB with ``--quick``) of
  ``CheckpointManager.save_async`` (first call: allocates its staging buffer; then: reuses
  it), of ``CheckpointManager.save`` (the whole durable save) and of DCP's
  ``torch.distributed.checkpoint.async_save`` (a gloo process group of one), each against a
  plain copy of the same state (``td.clone()``) measured in the same run - a first call
  against the first clone (both fault fresh memory in), the others against the best
  later clone. The target: ``save_async`` blocks for at most 1.2x the plain copy.
* Peak RSS over 20 ``save_async`` calls of that state (a fresh process): the growth after
  the first save, against the state's size. The target: < 5 %.

Blocking times are the best of several calls, each after the previous background save has
finished (a training step longer than the write: the call never waits for the one in
flight); the manager holds its root's writer lock before the first timed call (taking it,
once per manager, creates and fsyncs a file). Nothing asserts: the numbers are for people.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MiB = 1024**2
REPO = Path(__file__).resolve().parent.parent


def _state(total: int) -> Any:
    """A model-like state of ``total`` bytes: 8 big float leaves, small nested ones, a string."""
    from tensordict import NonTensorData, TensorDict

    n = 8
    small = TensorDict({f"b{i}": torch.randn(256) for i in range(16)})
    big = total - 16 * 256 * 4
    return TensorDict(
        {
            **{f"layer{i}": torch.randn(big // n // 4) for i in range(n)},
            "norms": small,
            "note": NonTensorData("epoch 3"),
        }
    )


def _blocking(call: Callable[[], Any], finish: Callable[[Any], Any], reps: int) -> list[float]:
    """Wall time of each ``call()`` (the main thread's wait); ``finish`` then waits it out."""
    times = []
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        handle = call()
        times.append(time.perf_counter() - start)
        finish(handle)
    return times


def _row(label: str, base: float, ours: float, base_name: str = "clone") -> None:
    print(
        f"  {label:<38} {base_name:>11} {base * 1e3:8.1f} ms   this {ours * 1e3:8.1f} ms   "
        f"ratio {ours / base:5.2f}"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dcp_blocking(work: Path, td: Any, reps: int) -> list[float]:
    """DCP's async_save on a gloo group of one: the main thread's wait per call."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = {k: v for k, v in td.flatten_keys(".").items() if isinstance(v, torch.Tensor)}
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        counter = iter(range(1_000_000))

        def call() -> Any:
            return dcp.async_save(state, checkpoint_id=str(work / f"dcp{next(counter)}"))

        return _blocking(call, lambda future: future.result(), reps)
    finally:
        dist.destroy_process_group()


def _rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def rss_loop(work: Path, total: int, saves: int) -> dict[str, Any]:
    """``saves`` save_async calls of one state (fresh process): RSS after each, and the peak."""
    from tdckpt import CheckpointManager, KeepLast

    td = _state(total)
    samples = []
    with CheckpointManager(work / "rss", retention=KeepLast(2), fsync=False) as mgr:
        before, _ = _rss_bytes()
        for step in range(saves):
            td["layer0"].add_(1)  # training changes the state between saves
            future = mgr.save_async(step, td)
            returned, _ = _rss_bytes()
            future.result()
            done, peak = _rss_bytes()
            samples.append({"returned": returned, "done": done, "peak": peak})
    return {"before": before, "samples": samples, "state": total}


def bench(work: Path, quick: bool) -> None:
    from tdckpt import CheckpointManager, KeepLast

    total = 32 * MiB if quick else 256 * MiB
    reps = 3 if quick else 5
    print(
        f"async: main-thread blocking time on a {total // MiB} MiB state (8 big leaves, 16 "
        "small, one string) vs a plain copy (td.clone()); peak RSS over 20 save_async calls"
    )
    td = _state(total)
    # The first clone faults its fresh memory in, as the first save_async's buffer does;
    # later ones mostly reuse memory the allocator kept.
    clone_first = _blocking(td.clone, lambda _: None, 1)[0]
    clone = min(_blocking(td.clone, lambda _: None, reps))

    counter = iter(range(1_000_000))
    (work / "async").mkdir()
    with CheckpointManager(work / "async", retention=KeepLast(2)) as mgr:
        mgr.gc()  # takes the root's writer lock (a file + fsyncs, once per manager) untimed

        def call() -> Any:
            return mgr.save_async(next(counter), td)

        first = _blocking(call, lambda future: future.result(), 1)[0]
        steady = min(_blocking(call, lambda future: future.result(), reps))

        def call_sync() -> Any:
            return mgr.save(next(counter), td)

        sync = min(_blocking(call_sync, lambda _: None, 2))
    dcp = _dcp_blocking(work, td, reps)
    _row("save_async, first call (allocates)", clone_first, first, "first clone")
    _row("save_async (buffer reused)", clone, steady)
    _row("save (checksums + fsync, blocking)", clone, sync)
    _row("DCP async_save, first call", clone_first, dcp[0], "first clone")
    _row("DCP async_save (best of the others)", clone, min(dcp[1:]))

    saves = 20
    out = subprocess.run(
        [sys.executable, __file__, "--rss", str(work), str(total), str(saves)],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    samples = report["samples"]
    base = samples[0]["done"]
    later_max = max(max(s["returned"], s["done"]) for s in samples[1:])
    peak_growth = samples[-1]["peak"] - samples[0]["peak"]
    growth = later_max - base
    print(
        f"  RSS over {saves} save_async calls: before {report['before'] / MiB:.0f} MiB, after "
        f"the first {base / MiB:.0f} MiB (+{(base - report['before']) / MiB:.0f} MiB: the "
        f"staging buffer), highest after a later one {later_max / MiB:.0f} MiB: growth "
        f"{growth / MiB:+.1f} MiB = {100 * growth / total:+.2f} % of the state; peak "
        f"(VmHWM) growth after the first {peak_growth / MiB:+.1f} MiB = "
        f"{100 * peak_growth / total:+.2f} %"
    )


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--rss":
    sys.path.insert(0, str(REPO))
    print(json.dumps(rss_loop(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
