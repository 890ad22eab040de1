"""Selective restore and safetensors export.

    python benchmarks/run.py selective [--quick]

* restore 1% of the leaves of a 1 GiB step (``restore(step, keys=[...])``) vs restoring it
  whole (``restore(step)``), on a local root and on object storage (a moto S3 server in a
  child process, see bench_remote.py; requests and bytes are those the server served).
  A restore is timed up to the bytes being usable: every restored leaf is summed (a local
  restore maps lazily; the page cache is warm, as right after a save; sums run on one
  thread). Target <= 0.05.
* ``tdckpt.export_safetensors`` of the same tensors vs ``safetensors.torch.save_file``, three
  ways: ``fsync=False`` vs save_file (neither syncs); the default ``fsync=True`` vs save_file
  followed by an fsync of its file (both durable); and the default vs save_file alone (the
  issue's ratio). Target <= 1.0.

The step: 1,024 leaves of 1 MiB (quick: 200 of 256 KiB). Each timing is the best of a few
alternating runs (5, the exports 7; quick: 3 and 5); the absolute baseline time is printed
beside each ratio. What a run
returns (a restore's mappings) is released after its timer stops.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20


def _tensors(quick: bool) -> dict[str, torch.Tensor]:
    n, nbytes = (200, MiB // 4) if quick else (1024, MiB)
    g = torch.Generator().manual_seed(0)
    return {f"w{i:04d}": torch.randn(nbytes // 4, generator=g) for i in range(n)}


def _touch(obj: Any) -> float:
    """Read every byte of every leaf (a restore is done when its bytes are usable)."""
    return float(sum(float(t.sum()) for t in obj.values(True, True)))


def _best(
    fns: dict[str, Callable[[], Any]], reps: int, setup: Callable[[], Any] | None = None
) -> dict[str, float]:
    """Best wall time of each function, run in alternation (drift stays out of ratios);
    ``setup()`` runs untimed before each."""
    best = dict.fromkeys(fns, float("inf"))
    names = list(fns)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            if setup is not None:
                setup()
            gc.collect()
            start = time.perf_counter()
            result = fns[name]()
            best[name] = min(best[name], time.perf_counter() - start)
            del result  # released outside the timer (a restore's unmapping is not its time)
    return best


def _row(
    label: str, base_name: str, base: float, ours: float, target: float, extra: str = ""
) -> None:
    ratio = ours / base
    mark = "ok" if ratio <= target else "MISSED"
    print(
        f"    {label:<34} {base_name} {base * 1e3:9.1f} ms   tdckpt {ours * 1e3:9.1f} ms   "
        f"ratio {ratio:6.3f} (target <= {target}: {mark}){extra}"
    )


def _selective(mgr: Any, keys: list[str], reps: int, label: str, server: Any = None) -> None:
    counts: dict[str, tuple[int, int]] = {}
    if server is None:  # a local restore maps lazily: the call alone, for the record
        lazy = _best(
            {"whole": lambda: mgr.restore(1), "part": lambda: mgr.restore(1, keys=keys)}, reps
        )
        print(
            f"    {label}: the restore call alone (leaves mapped, not read): whole "
            f"{lazy['whole'] * 1e3:.1f} ms, 1% {lazy['part'] * 1e3:.1f} ms (metadata-bound)"
        )

    def run(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def go() -> Any:
            before = server.counts() if server is not None else (0, 0)
            restored = fn()
            _touch(restored)
            after = server.counts() if server is not None else (0, 0)
            counts[name] = (after[0] - before[0], after[1] - before[1])
            return restored  # released by _best once the timer stopped

        return go

    times = _best(
        {
            "whole": run("whole", lambda: mgr.restore(1)),
            "part": run("part", lambda: mgr.restore(1, keys=keys)),
        },
        reps,
    )
    extra = ""
    if server is not None:
        extra = (
            f"   requests {counts['part'][0]} vs {counts['whole'][0]}, "
            f"bytes {counts['part'][1] / MiB:.1f} vs {counts['whole'][1] / MiB:.1f} MiB"
        )
    _row(f"{label}: 1% of the leaves / whole", "whole", times["whole"], times["part"], 0.05, extra)
    print(
        json.dumps(
            {
                "bench": "selective",
                "store": label,
                "whole_s": times["whole"],
                "part_s": times["part"],
                "counts": counts,
            }
        )
    )


def bench(work: Path, quick: bool) -> None:
    # Leaves are summed on one thread: waking torch's intra-op pool for each small sum
    # costs more than the sum on a loaded machine, and would be timed as restore time.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _bench(work, quick)
    finally:
        torch.set_num_threads(threads)


def _bench(work: Path, quick: bool) -> None:
    from tensordict import TensorDict

    import tdckpt
    from tdckpt import CheckpointManager

    tensors = _tensors(quick)
    total = sum(t.numel() * 4 for t in tensors.values())
    keys = sorted(tensors)[::100][: max(1, len(tensors) // 100)]
    td = TensorDict(tensors, batch_size=[])
    reps = 3 if quick else 5
    print(
        f"selective: {len(tensors)} leaves, {total / MiB:.0f} MiB; restoring {len(keys)} of "
        "them vs the whole step"
    )

    root = work / "selective-local"
    with CheckpointManager(root) as mgr:
        mgr.save(1, td)
        _selective(mgr, keys, reps, "local root")
    shutil.rmtree(root)

    try:
        server = _CountingServer()
    except (RuntimeError, ImportError, OSError) as exc:
        print(f"    (object storage skipped: {exc}; pip install 'tdckpt[remote]' 'moto[server]')")
    else:
        try:
            options = server.options()
            with CheckpointManager(f"s3://{server.bucket()}/run", storage_options=options) as mgr:
                mgr.save(1, td)
                _selective(mgr, keys, reps, "moto S3", server)
        finally:
            server.close()

    try:
        from safetensors.torch import save_file
    except ImportError:
        print("    (safetensors export skipped: pip install safetensors)")
        return
    out = work / "selective-export"
    out.mkdir()

    def fresh() -> None:
        # Each writer starts from an empty folder and no dirty pages: neither pays for
        # unlinking the previous run's 1 GiB file nor for the other's writeback.
        for old in out.iterdir():
            old.unlink()
        os.sync()

    def save_file_synced() -> None:
        path = out / "base_sync.safetensors"
        save_file(tensors, str(path))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    times = _best(
        {
            "save_file": lambda: save_file(tensors, str(out / "base.safetensors")),
            "save_file_fsync": save_file_synced,
            "export": lambda: tdckpt.export_safetensors(
                td, out / "ours.safetensors", overwrite=True, fsync=False
            ),
            "export_fsync": lambda: tdckpt.export_safetensors(
                td, out / "ours_sync.safetensors", overwrite=True
            ),
        },
        reps + 2,  # writes of 1 GiB vary more from run to run than reads from the cache
        fresh,
    )
    _row(
        "export(fsync=False) / save_file",
        "save_file",
        times["save_file"],
        times["export"],
        1.0,
    )
    _row(
        "export / (save_file + fsync)",
        "save_file+fsync",
        times["save_file_fsync"],
        times["export_fsync"],
        1.0,
    )
    _row(
        "export (default, synced) / save_file",
        "save_file",
        times["save_file"],
        times["export_fsync"],
        1.0,
    )
    print(json.dumps({"bench": "selective", "export": times}))
    shutil.rmtree(out)


#: bench_remote's moto server script, its counting wrapper also summing GET body bytes
#: (``GET /__tdckpt_sent`` reads the sum).
_SERVER = r"""
import logging, sys, threading
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
app = server._server.app
count, sent = [0], [0]
lock = threading.Lock()
def counting(environ, start_response):
    path = environ.get("PATH_INFO")
    if path in ("/__tdckpt_requests", "/__tdckpt_sent"):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [str((count if path == "/__tdckpt_requests" else sent)[0]).encode()]
    with lock:
        count[0] += 1
    result = app(environ, start_response)
    body = b"".join(result)
    if hasattr(result, "close"):
        result.close()
    if environ["REQUEST_METHOD"] == "GET":
        with lock:
            sent[0] += len(body)
    return [body]
server._server.app = counting
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()
"""


def _CountingServer() -> Any:
    """A bench_remote.Server running :data:`_SERVER`, with ``counts()``: (requests, GET bytes)."""
    import subprocess
    import sys
    import urllib.request

    import bench_remote

    class Counting(bench_remote.Server):
        def __init__(self) -> None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self.proc.stdout is not None
            self.endpoint = self.proc.stdout.readline().strip()
            if not self.endpoint.startswith("http://"):
                self.proc.kill()
                raise RuntimeError("the moto server did not start")

        def counts(self) -> tuple[int, int]:
            with urllib.request.urlopen(self.endpoint + "/__tdckpt_sent", timeout=10) as r:
                sent = int(r.read())
            return self.requests(), sent

    return Counting()
