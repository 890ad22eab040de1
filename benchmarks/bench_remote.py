"""Object storage: tdckpt vs DCP's fsspec writer/reader against the same moto S3 server.

    python benchmarks/run.py remote [--quick]

Needs ``pip install 'tdckpt[remote]' 'moto[server]'``. A ``ThreadedMotoServer`` on
127.0.0.1 runs in a child process (so the server does not share the benchmark's GIL); a
WSGI wrapper counts the requests it serves (``GET /__tdckpt_requests`` reads the count,
and is not counted). Two workloads: 256 MiB in 16 leaves, and 1,000 small leaves.

* save: ``CheckpointManager(s3://...).save`` (checksums, upload under a fresh attempt,
  conditional-create commit; the lease taken before timing) vs ``dcp.save`` with
  ``FsspecWriter(thread_count=16)`` (one file per thread, ``.metadata`` written then
  "renamed" - copy + delete on S3).
* restore: ``restore_into`` (ranged concurrent reads, checksums verified, the in-place
  engine) vs ``dcp.load`` with ``FsspecReader`` into the same preallocated tensors.

Each timing is the best of a few alternating runs; requests are those of one run. Ratios < 1 mean
tdckpt is faster / sends fewer requests.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20

_SERVER = r"""
import logging, sys, threading
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
app = server._server.app
count = [0]
lock = threading.Lock()
def counting(environ, start_response):
    if environ.get("PATH_INFO") == "/__tdckpt_requests":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [str(count[0]).encode()]
    with lock:
        count[0] += 1
    return app(environ, start_response)
server._server.app = counting
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()
"""


class Server:
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
            raise RuntimeError("the moto server did not start (pip install 'moto[server]')")

    def requests(self) -> int:
        with urllib.request.urlopen(self.endpoint + "/__tdckpt_requests", timeout=10) as r:
            return int(r.read())

    def options(self) -> dict[str, Any]:
        return {
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }

    def bucket(self) -> str:
        import boto3

        name = f"bench{uuid.uuid4().hex[:16]}"
        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        ).create_bucket(Bucket=name)
        return name

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.terminate()
        self.proc.wait(10)


def _workloads(quick: bool) -> list[tuple[str, dict[str, torch.Tensor]]]:
    big_total = (32 if quick else 256) * MiB
    small_n = 200 if quick else 1000
    g = torch.Generator().manual_seed(0)
    big = {f"w{i}": torch.randn(big_total // 16 // 4, generator=g) for i in range(16)}
    small = {f"p{i}": torch.randn(256, generator=g) for i in range(small_n)}
    return [
        (f"{big_total // MiB} MiB in 16 leaves", big),
        (f"{small_n:,} small leaves", small),
    ]


def _timed(fn: Any, server: Server) -> tuple[float, int]:
    gc.collect()
    before = server.requests()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return elapsed, server.requests() - before


def _workload(server: Server, label: str, tensors: dict[str, torch.Tensor], reps: int) -> None:
    import torch.distributed.checkpoint as dcp
    from tensordict import TensorDict
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from tdckpt import CheckpointManager

    options = server.options()
    bucket = server.bucket()
    td = TensorDict(tensors, batch_size=[])
    results: dict[str, list[tuple[float, int]]] = {}
    mgr = CheckpointManager(f"s3://{bucket}/tdckpt", storage_options=options)
    mgr._ensure_lock()  # the lease: once per run, not per save

    def dcp_save(rep: int) -> None:
        writer = FsspecWriter(f"s3://{bucket}/dcp{rep}", thread_count=16, **options)
        dcp.save(dict(tensors), storage_writer=writer, no_dist=True)

    # Alternate, and swap which goes first on every run, so that drift of the machine (and
    # of the server's heap) stays out of the ratio.
    for rep in range(reps):
        runs = [
            ("tdckpt save", lambda: mgr.save(rep, td)),  # noqa: B023 - called right here
            ("dcp save", lambda: dcp_save(rep)),  # noqa: B023
        ]
        for name, fn in runs[:: 1 if rep % 2 == 0 else -1]:
            results.setdefault(name, []).append(_timed(fn, server))
    for rep in range(reps):
        target = TensorDict({k: torch.empty_like(v) for k, v in tensors.items()}, [])
        state = {k: torch.empty_like(v) for k, v in tensors.items()}
        reader = FsspecReader(f"s3://{bucket}/dcp{rep}", **options)
        runs = [
            ("tdckpt restore", lambda: mgr.restore_into(target, rep)),  # noqa: B023
            ("dcp restore", lambda: dcp.load(state, storage_reader=reader, no_dist=True)),  # noqa: B023
        ]
        for name, fn in runs[:: 1 if rep % 2 == 0 else -1]:
            results.setdefault(name, []).append(_timed(fn, server))
        assert all(torch.equal(target[k], v) for k, v in tensors.items())
        assert all(torch.equal(state[k], v) for k, v in tensors.items())
    mgr.close()
    print(f"  {label}")
    for op in ("save", "restore"):
        ours_t = min(t for t, _ in results[f"tdckpt {op}"])
        base_t = min(t for t, _ in results[f"dcp {op}"])
        ours_r = results[f"tdckpt {op}"][-1][1]
        base_r = results[f"dcp {op}"][-1][1]
        print(
            f"    {op:<8} DCP {base_t * 1e3:9.1f} ms {base_r:5d} req   tdckpt "
            f"{ours_t * 1e3:9.1f} ms {ours_r:5d} req   time ratio {ours_t / base_t:5.2f}"
            f"   request ratio {ours_r / max(base_r, 1):5.2f}"
        )
    summary = {
        k: {"best_s": min(t for t, _ in v), "requests": v[-1][1]} for k, v in results.items()
    }
    print(json.dumps({"bench": "remote", "workload": label, **summary}))


def bench(work: Path, quick: bool) -> None:
    import warnings

    # DCP without a process group says "assuming ... a single process" on every call
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    print("remote: tdckpt vs DCP FsspecWriter/FsspecReader on one moto S3 server (127.0.0.1)")
    server = Server()
    try:
        for label, tensors in _workloads(quick):
            _workload(server, label, tensors, 2 if quick else 4)
    finally:
        server.close()
