"""One rank of a sharded-checkpoint test (run by tests/test_sharded*.py, never by pytest).

    spawn_ranks(command, world, args)   # from a test

starts ``world`` ranks (forkserver children), each joins a gloo group through the test
process's TCP store on 127.0.0.1 (it outlives every rank), runs <command> and writes
``{"ok": ...}`` or ``{"error": [type, message]}`` to ``<args.out>/rank<rank>.json``.
``args["manager"]``: more keyword arguments of each rank's CheckpointManager (e.g.
``{"layout": "consolidated"}``).
The cases' global TensorDicts (:func:`make_case`) are deterministic, so the test process
rebuilds the same reference and every rank cuts its own shard from it.

Fault injection (only here): ``TDCKPT_TEST_FAULT="<rank>:<phase>"`` kills that rank with
``os._exit(9)`` at a phase of the save protocol (tdckpt._shard.save.fault_point), or in the
middle of writing its first leaf file (``mid_leaf``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tensordict import NonTensorData, NonTensorStack, TensorDict, tensorclass  # noqa: E402

#: Rows of each rank's shard for a world of N ranks (uneven; one empty shard at N=4).
LENGTHS = {1: [11], 2: [4, 9], 3: [5, 1, 7], 4: [6, 0, 3, 8]}

CASES = ("nested", "nontensor", "tensorclass", "replicated")


@tensorclass
class Particles:
    pos: torch.Tensor
    vel: torch.Tensor
    label: str


def make_case(case: str, rows: int) -> Any:
    """The global object of ``case`` with ``rows`` rows (same values in every process)."""
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    if case == "nested":
        return TensorDict(
            a=torch.randn(rows, 2, 3, generator=g),
            b=torch.arange(rows * 2, dtype=torch.int64).reshape(rows, 2),
            nested=TensorDict(
                c=torch.rand(rows, 2, generator=g) > 0.5,
                deeper=TensorDict(d=torch.randn(rows, 2, generator=g).half(), batch_size=[rows, 2]),
                batch_size=[rows, 2],
            ),
            batch_size=[rows, 2],
        )
    if case == "nontensor":
        td = TensorDict(x=torch.randn(rows, generator=g), batch_size=[rows])
        td["label"] = NonTensorStack(*[f"row-{i}" for i in range(rows)]) if rows else "none"
        td["const"] = "hello"
        return td
    if case == "tensorclass":
        return Particles(
            pos=torch.randn(rows, 3, generator=g),
            vel=torch.randn(rows, 3, generator=g).double(),
            label="swarm",
            batch_size=[rows],
        )
    if case == "replicated":
        td = TensorDict(x=torch.arange(rows, dtype=torch.float32), batch_size=[rows])
        td["run"] = "exp-1"
        td["cfg"] = TensorDict(batch_size=[rows])
        td["cfg", "lr"] = NonTensorData(0.25)
        return td
    raise ValueError(case)


def replicated_of(case: str) -> tuple[Any, ...]:
    return ("run", "cfg") if case == "replicated" else ()


def shard_of(case: str, world: int, rank: int) -> Any:
    lengths = LENGTHS[world]
    whole = make_case(case, sum(lengths))
    start = sum(lengths[:rank])
    return whole[start : start + lengths[rank]]


def step_of(case: str) -> int:
    return 10 * (CASES.index(case) + 1)


def install_fault() -> None:
    spec = os.environ.get("TDCKPT_TEST_FAULT")
    if not spec:
        return
    who, phase = spec.split(":")
    if int(who) != int(os.environ["RANK"]):
        return
    if phase == "mid_leaf":
        from tdckpt._write import writer

        real_write, real_bytes = writer.write_all, writer.as_bytes
        armed = []

        def tensor_bytes(t: torch.Tensor) -> memoryview:
            armed.append(True)  # the next write is a leaf's bytes
            return real_bytes(t)

        def half_then_die(fd: int, data: memoryview) -> None:
            if armed and len(data) > 1:
                real_write(fd, data[: len(data) // 2])
                os._exit(9)
            real_write(fd, data)

        writer.as_bytes = tensor_bytes  # type: ignore[assignment]
        writer.write_all = half_then_die  # type: ignore[assignment]
        return
    from tdckpt._shard import save as shard_save

    def die(at: str) -> None:
        if at == phase:
            os._exit(9)

    shard_save.fault_point = die


def rank_main(command: str, rank: int, world: int, port: int, args: dict[str, Any]) -> None:
    """One rank: join the group, run ``command``, write ``rank<rank>.json`` into args["out"]."""
    out = Path(args["out"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), **args.get("env", {}))
    import torch.distributed as dist

    from tdckpt import CheckpointManager

    result: dict[str, Any]
    try:
        # The rendezvous store is the parent's (spawn_ranks): it outlives every rank, so a
        # rank that is done may exit while a peer still joins a group through it.
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        mgr = CheckpointManager(
            args["root"], timeout=args.get("timeout", 60), **args.get("manager", {})
        )
        install_fault()
        try:
            result = {"ok": _command(command)(mgr, rank, world, args)}
        finally:
            mgr.close()  # a surviving rank 0 lets go of the root's writer lock
    except BaseException as exc:
        result = {"error": [type(exc).__name__, str(exc), traceback.format_exc()]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no destroy_process_group: a broken group must not hang the exit


def _command(command: str) -> Any:
    """``COMMANDS[command]``, or ``"module:function"`` of another test helper module (whose
    commands then live beside the tests that use them)."""
    if ":" in command:
        import importlib

        module, name = command.split(":", 1)
        return getattr(importlib.import_module(module), name)
    return COMMANDS[command]


_CTX: Any = None


def ok_results(results: list[dict[str, Any] | None], what: str) -> list[Any]:
    """Each rank's result of :func:`spawn_ranks`, failing the test on a rank that died or
    raised (its traceback shown)."""
    for rank, res in enumerate(results):
        assert res is not None, f"{what}: rank {rank} died"
        assert "ok" in res, f"{what}: rank {rank} raised:\n{res['error'][2]}"
    return [res["ok"] for res in results if res is not None]


def spawn_ranks(
    command: str, world: int, args: dict[str, Any], *, timeout: float = 120
) -> list[dict[str, Any] | None]:
    """Run ``command`` on ``world`` ranks (forkserver children: torch is imported once).

    Returns each rank's result (None for a rank that died); kills every rank still alive
    after ``timeout`` seconds and fails.
    """
    import multiprocessing
    import time

    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "tensordict", "tdckpt", "_shard_child"])
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        _CTX.Process(target=rank_main, args=(command, r, world, port, args), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert not hung, f"ranks {hung} of {world} still ran after {timeout} s ({command})"
    results: list[dict[str, Any] | None] = []
    for r in range(world):
        path = out / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def cmd_save(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    for case in args.get("cases", CASES):
        mgr.save(
            args.get("step", step_of(case)),
            shard_of(case, args.get("lengths_of", world), rank),
            replicated=replicated_of(case),
            metadata={"case": case},
            overwrite=args.get("overwrite", False),
        )
    return mgr.steps()


def cmd_restore(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Restore every case of every root in args["roots"]; compare with the reference."""
    from _shard_compare import assert_same

    from tdckpt import CheckpointManager
    from tdckpt._shard.rows import even_part

    checked = []
    for saved_by, root in args["roots"]:
        m = CheckpointManager(root, timeout=60)
        for case in CASES:
            total = sum(LENGTHS[saved_by])
            whole = make_case(case, total)
            start, stop = even_part(total, rank, world)
            got = m.restore(step_of(case))
            assert_same(got, whole[start:stop], f"{saved_by}->{world} {case} rank {rank}")
            # an explicit slice, crossing shard borders
            lo, hi = total // 3, total - 1
            got = m.restore(step_of(case), rows=slice(lo, hi))
            assert_same(got, whole[lo:hi], f"{saved_by}->{world} {case} rows {lo}:{hi}")
            # restore_into: rank r takes r + 1 rows, offsets in rank order
            take = [r + 1 for r in range(world)]
            if sum(take) <= total:
                target = make_case(case, take[rank])  # same structure, other values
                m.restore_into(target, step_of(case))
                off = sum(take[:rank])
                assert_same(target, whole[off : off + take[rank]], f"restore_into {case}")
            checked.append([saved_by, case])
    return checked


def cmd_fault(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Save step 1 (case "nested"); then save step 2, or overwrite step 1 with the
    "tensorclass" case, with args["fault"] (``"<rank>:<phase>"``) armed."""
    import time

    mgr.save(1, shard_of("nested", world, rank))
    os.environ["TDCKPT_TEST_FAULT"] = args["fault"]
    install_fault()
    overwrite = args.get("overwrite", False)
    start = time.monotonic()
    try:
        if overwrite:
            mgr.save(1, shard_of("tensorclass", world, rank), overwrite=True)
        else:
            mgr.save(2, shard_of("nested", world, rank)[:, :1])
    except Exception as exc:
        from tdckpt.errors import TdckptError

        return {
            "raised": type(exc).__name__,
            "tdckpt": isinstance(exc, TdckptError),
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"raised": None, "seconds": time.monotonic() - start}


def cmd_mismatch(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Rank 1 saves other keys than the rest: every rank must raise, nothing committed."""
    shard = shard_of("nested", world, rank)
    if rank == 1:
        shard = shard.exclude(("nested", "c"))
    out: dict[str, Any] = {}
    try:
        mgr.save(5, shard)
    except Exception as exc:
        out["mismatch"] = [type(exc).__name__, str(exc)]
    try:  # rank 0 refuses: step 5 does not exist but step 1 does after this save
        mgr.save(1, shard_of("nested", world, rank))
        mgr.save(1, shard_of("nested", world, rank))
    except Exception as exc:
        out["exists"] = [type(exc).__name__, str(exc)]
    out["steps"] = mgr.steps()
    return out


def cmd_subgroup(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Ranks 1 and 2 of 3 save and restore on their own group (group=...), rank 0 idles."""
    import torch.distributed as dist

    from tdckpt import CheckpointManager

    sub = dist.new_group(ranks=[1, 2])  # every rank of the world creates it
    out: dict[str, Any] = {"world_group": mgr.tdckpt_group is not None}
    if rank == 0:  # alone, not collective: lists and reads without the other ranks
        alone = CheckpointManager(args["root"], group=False)
        assert alone.tdckpt_group is None and alone.steps() == []
        alone.save(1, make_case("nontensor", 10))  # a plain, one-process step
        alone.close()
    dist.barrier()
    # a plain step restores in a group too: each rank its tensor_split part
    from _shard_compare import assert_same

    from tdckpt._shard.rows import even_part

    start, stop = even_part(10, rank, world)
    assert_same(mgr.restore(1), make_case("nontensor", 10)[start:stop], f"plain step {rank}")
    if rank in (1, 2):
        m = CheckpointManager(args["sub_root"], group=sub, timeout=60)
        out["sub_rank"] = dist.get_rank(m.tdckpt_group)
        m.save(3, shard_of("nested", 2, rank - 1))
        got = m.restore(3)
        from _shard_compare import assert_same

        from tdckpt._shard.rows import even_part

        whole = make_case("nested", sum(LENGTHS[2]))
        start, stop = even_part(sum(LENGTHS[2]), rank - 1, 2)
        assert_same(got, whole[start:stop], f"subgroup rank {rank}")
        out["steps"] = m.steps()
        m.close()
    dist.barrier()
    return out


def cmd_async(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """save_async every case, then write into every tensor of the shard before the commit."""
    for case in CASES:
        shard = shard_of(case, world, rank)
        future = mgr.save_async(
            step_of(case), shard, replicated=replicated_of(case), metadata={"case": case}
        )
        for key in shard.keys(include_nested=True, leaves_only=True):
            value = shard.get(key)
            if isinstance(value, torch.Tensor) and value.numel():
                value.fill_(True if value.dtype is torch.bool else 7)  # training goes on
        future.result(timeout=60)
    return mgr.steps()


def cmd_async_refusal(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """save_async whose metadata only rank 1 refuses (a NaN loss), then a good save_async
    and a restore: the refusal reaches every rank's result(), and the group stays usable."""
    shard = shard_of("nested", world, rank)
    loss = float("nan") if rank == 1 else 0.5
    outcomes = [_outcome(lambda: mgr.save_async(2, shard, metadata={"loss": loss}).result(60))]
    outcomes.append(_outcome(lambda: mgr.save_async(3, shard, metadata={"loss": 0.1}).result(60)))
    restored = mgr.restore(3)
    keys = sorted(map(str, shard.keys(include_nested=True, leaves_only=True)))
    outcomes.append(sorted(map(str, restored.keys(include_nested=True, leaves_only=True))) == keys)
    return {"outcomes": outcomes, "steps": mgr.steps()}


def _outcome(call: Any) -> list[Any]:
    try:
        call()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return ["returned", None]


def cmd_disagree(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Ranks that call other operations or steps: every rank raises, nothing is touched."""
    from _shard_compare import assert_same

    out: dict[str, Any] = {}
    root = Path(args["root"])
    # save(5) on rank 0, save(6) elsewhere: nothing may be written, not even the lock file
    out["save"] = _outcome(lambda: mgr.save(5 if rank == 0 else 6, shard_of("nested", world, rank)))
    out["root_after_save"] = sorted(os.listdir(root)) if root.exists() else None
    # a bad step on one rank only: the same refusal everywhere (no rank waits for the others)
    out["bad_step"] = _outcome(
        lambda: mgr.save(-1 if rank == 1 else 7, shard_of("nested", world, rank))
    )
    for step in (1, 2):
        mgr.save(
            step,
            shard_of("nested", world, rank)[:, :1]
            if step == 2
            else shard_of("nested", world, rank),
        )
    # restore_into of step 1 on rank 0, of step 2 elsewhere: no target may change
    target = shard_of("tensorclass", world, rank)
    kept = target.clone()
    out["restore_into"] = _outcome(lambda: mgr.restore_into(target, 1 if rank == 0 else 2))
    assert_same(target, kept, f"rank {rank}'s target after restore_into of other steps")
    out["restore"] = _outcome(lambda: mgr.restore(1 if rank == 0 else 2))
    # restore on rank 0 while the others save
    out["mixed"] = _outcome(
        lambda: mgr.restore(1) if rank == 0 else mgr.save(3, shard_of("nested", world, rank))
    )
    # one rank's target has other keys: it raises its RestoreError, every other rank a
    # CollectiveError, and no rank's target changes
    target = shard_of("nested", world, rank).apply(lambda t: t.zero_())
    if rank == 1:
        target = target.exclude(("nested", "c"))
    kept = target.clone()
    out["one_refuses"] = _outcome(lambda: mgr.restore_into(target, 1))
    assert_same(target, kept, f"rank {rank}'s target after a refusal on rank 1")
    # and afterwards the group still works: the same call on every rank
    got = mgr.restore(1)
    from tdckpt._shard.rows import even_part

    total = sum(LENGTHS[world])
    start, stop = even_part(total, rank, world)
    assert_same(got, make_case("nested", total)[start:stop], f"rank {rank} restore after")
    out["steps"] = mgr.steps()
    out["tmp"] = sorted(n for n in os.listdir(root) if ".tmp-" in n)
    return out


def cmd_close(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """close() frees the gloo group the manager made, never the user's group."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from tdckpt import CheckpointManager

    out: dict[str, Any] = {"before": len(c10d._world.pg_map)}
    for i in range(3):
        m = CheckpointManager(Path(args["root"]) / f"m{i}", timeout=60)
        m.save(1, shard_of("nested", world, rank))
        pg = m.tdckpt_group
        assert pg in c10d._world.pg_map
        m.close()
        assert pg not in c10d._world.pg_map, "close() left the manager's gloo group"
    out["after"] = len(c10d._world.pg_map)
    mine = dist.new_group(backend="gloo")
    m = CheckpointManager(Path(args["root"]) / "given", group=mine, timeout=60)
    m.save(1, shard_of("nested", world, rank))
    m.close()
    out["given_kept"] = mine in c10d._world.pg_map
    out["given_works"] = dist.all_reduce(torch.ones(1), group=mine) is None
    out["after_close"] = _outcome(lambda: m.save(2, shard_of("nested", world, rank)))
    out["restore_after_close"] = _outcome(lambda: m.restore(1))
    with CheckpointManager(Path(args["root"]) / "with", timeout=60) as w:
        w.save(1, shard_of("nested", world, rank))
        pg = w.tdckpt_group
    out["with_freed"] = pg not in c10d._world.pg_map
    groups = len(c10d._world.pg_map)
    out["refused"] = [
        _outcome(lambda: CheckpointManager(Path(args["root"]) / "b1", archive=True)),
        _outcome(
            lambda: CheckpointManager(
                Path(args["root"]) / "b2", layout="consolidated", incremental=True
            )
        ),
    ]
    out["refused_groups"] = len(c10d._world.pg_map) - groups
    return out


def _sub_td(v: float, rows: int) -> Any:
    """The substitution suite's state (tests/test_substitution.py), with ``rows`` rows."""
    return TensorDict(
        model=TensorDict(w=torch.full((rows, 3), v), batch_size=[rows]),
        step=torch.full((rows,), int(v)),
        batch_size=[rows],
    )


def cmd_substitution(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Every public method of a collective manager, as tests/test_substitution.py calls it
    on the other roots: each result, or the refusal as ``[error class, message]``."""
    import torch.distributed as dist

    from tdckpt import CheckpointManager, KeepLast

    rows = LENGTHS[world][rank]
    out: dict[str, Any] = {}

    def call(name: str, fn: Any) -> Any:
        try:
            out[name] = ["ok", fn()]
        except Exception as exc:
            out[name] = [type(exc).__name__, str(exc)]
        return out[name][1]

    with CheckpointManager(Path(args["root"]) / "sub", retention=KeepLast(2), timeout=60) as m:
        out["group"] = m.tdckpt_group is not None
        out["empty"] = [m.steps(), m.latest_step()]
        for step in (1, 2, 3):
            m.save(step, _sub_td(step, rows), metadata={"loss": 1.0 / step})
        m.save_async(4, _sub_td(4, rows), metadata={"loss": 0.1}).result(timeout=60)
        dist.barrier(group=m.tdckpt_group)  # rank 0 applies retention after the outcome
        out["steps"] = [m.steps(), m.latest_step()]
        out["best"] = [m.best_step("loss"), m.metadata(3)]
        out["list_steps"] = [[s.step, s.kind, s.status] for s in m.list_steps()]
        out["verify"] = [m.verify(3).ok, m.verify().ok]
        out["prune_gc"] = [m.prune(), m.gc(grace_period=0)]
        got = m.restore(3)
        out["restore"] = [
            list(got.batch_size),
            bool((got["model", "w"] == 3.0).all()),
            bool((got["step"] == 3).all()),
        ]
        target = _sub_td(0, rows)
        m.restore_into(target, step=3)
        out["restore_into"] = [bool((target["model", "w"] == 3.0).all())]

        def keys_only() -> Any:
            part, report = m.restore(4, keys="model", report=True)
            return [sorted(part.keys()), [list(k) for k in report.loaded]]

        def keys_into() -> Any:
            m.restore_into(target, step=4, keys="model")
            return [bool((target["model", "w"] == 4.0).all()), bool((target["step"] == 3).all())]

        call("restore_keys", keys_only)
        call("restore_into_keys", keys_into)
        # the refusals of test_refusals_are_the_same_error_on_every_root
        call("restore_missing", lambda: m.restore(7))
        call("metadata_missing", lambda: m.metadata(7))
        call("gc_negative", lambda: m.gc(grace_period=-1))
        call("save_existing", lambda: m.save(3, _sub_td(2, rows)))
        # a bad step argument: ValueError on every rank, as in one process (rank 1 raised
        # RestoreError for rank 0's refusal)
        call("restore_bad_step", lambda: m.restore(-1))
        call("restore_into_bad_step", lambda: m.restore_into(target, step=True))
        out["steps_after"] = m.steps()
    return out


def cmd_select(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Selective restores of the steps saved by ``world`` ranks; what each rank opened."""
    from _fs_access import OpenLog
    from _shard_compare import assert_same

    from tdckpt._shard.rows import even_part
    from tdckpt.errors import RestoreError, TdckptError

    total = sum(LENGTHS[world])
    start, stop = even_part(total, rank, world)
    out: dict[str, Any] = {}
    nested = make_case("nested", total)
    step_dir = Path(args["root"]) / str(step_of("nested"))
    with OpenLog(step_dir) as seen:
        got, report = mgr.restore(step_of("nested"), keys="nested.deeper", report=True)
    want = nested[start:stop].select(("nested", "deeper"))
    assert_same(got, want, f"rank {rank}: keys=nested.deeper")
    out["opened"] = sorted(seen.leaves_opened())
    out["loaded"] = [list(k) for k in report.loaded]
    got = mgr.restore(step_of("nested"), keys="a", dtype=torch.bfloat16, rename={"a": "obs"})
    assert torch.equal(got["obs"], nested["a"][start:stop].bfloat16()), f"rank {rank}: cast"
    out["cast"] = str(got["obs"].dtype)
    out["skipped"] = sorted(list(k) for k in report.skipped)

    rep = make_case("replicated", total)
    got, report = mgr.restore(step_of("replicated"), keys=["run", "cfg"], report=True)
    assert_same(got, rep[start:stop].select("run", "cfg"), f"rank {rank}: replicated only")
    out["replicated_loaded"] = sorted(list(k) for k in report.loaded)
    got = mgr.restore(step_of("replicated"), exclude="run")
    assert_same(got, rep[start:stop].exclude("run"), f"rank {rank}: exclude=run")
    try:
        mgr.restore(step_of("replicated"), keys=["x", "nope"])
    except RestoreError as exc:
        out["strict"] = str(exc)
    _, report = mgr.restore(step_of("replicated"), keys=["x", "nope"], strict=False, report=True)
    out["missing"] = [list(k) for k in report.missing]

    # in place: rank r takes r + 1 rows; only the selected keys change
    take = [r + 1 for r in range(world)]
    off = sum(take[:rank])
    target = make_case("nested", take[rank]).apply(torch.zeros_like)
    with OpenLog(step_dir) as seen:
        _, report = mgr.restore_into(target, step_of("nested"), keys="a", report=True)
    assert torch.equal(target["a"], nested["a"][off : off + take[rank]])
    assert not target["b"].any() and not target["nested", "deeper", "d"].any()
    out["into_opened"] = sorted(seen.leaves_opened())
    out["into_loaded"] = [list(k) for k in report.loaded]
    # strict: the selection's keys must match; a refusal on one rank leaves every target as is
    target = make_case("nested", take[rank]).apply(torch.zeros_like)
    if rank == 0:
        del target["nested", "deeper", "d"]
    try:
        mgr.restore_into(target, step_of("nested"), keys="nested.deeper")
    except TdckptError as exc:  # rank 0: the RestoreError; rank 1: told that rank 0 failed
        out["into_strict"] = f"{type(exc).__name__}: {exc}"
    assert not target["a"].any() and all(
        not v.any() for v in target.values(True, True) if isinstance(v, torch.Tensor)
    )
    if rank == 0:
        _, report = mgr.restore_into(
            target, step_of("nested"), keys="nested.deeper", strict=False, report=True
        )
    else:
        _, report = mgr.restore_into(target, step_of("nested"), keys="nested.deeper", report=True)
    out["into_unexpected"] = [list(k) for k in report.unexpected]
    assert not target["nested", "c"].any()  # beside the selection, in the same level: kept
    assert torch.equal(
        target["nested", "deeper", "d"], nested["nested", "deeper", "d"][off : off + take[rank]]
    )
    return out


def incremental_shard(step: int, rank: int) -> Any:
    """Rank ``rank``'s shard at ``step`` of the incremental case: ``frozen`` never changes,
    ``moving`` changes at every step."""
    rows = 4
    return TensorDict(
        frozen=torch.arange(rows * 1000, dtype=torch.float32).reshape(rows, 1000) + rank,
        moving=torch.full((rows, 10), float(step * 10 + rank)),
        batch_size=[rows],
    )


def cmd_incremental(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Sharded incremental saves: steps 1 and 2, each rank against its own shard."""
    for step in (1, 2):
        mgr.save(step, incremental_shard(step, rank), incremental=True)
    return mgr.steps()


COMMANDS = {
    "incremental": cmd_incremental,
    "substitution": cmd_substitution,
    "select": cmd_select,
    "close": cmd_close,
    "disagree": cmd_disagree,
    "async": cmd_async,
    "async_refusal": cmd_async_refusal,
    "subgroup": cmd_subgroup,
    "save": cmd_save,
    "restore": cmd_restore,
    "fault": cmd_fault,
    "mismatch": cmd_mismatch,
}
