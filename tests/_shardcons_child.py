"""The ranks' side of tests/test_sharded_consolidated.py (run through tests/_shard_child.py
as ``"_shardcons_child:<command>"``, each rank's manager made with ``layout="consolidated"``).
"""

from __future__ import annotations

from typing import Any

import torch
from _shard_child import LENGTHS, make_case, replicated_of, shard_of

#: The cases saved as consolidated shards: step -> case.
STEPS = {1: "nested", 2: "tensorclass", 3: "replicated"}


def reference(case: str, rows: int) -> Any:
    """What a consolidated step of ``case`` restores: a top-level tensorclass comes back as
    its TensorDict (tensordict writes it so, and ``from_consolidated`` reads it so)."""
    whole = make_case(case, rows)
    return whole._tensordict if case == "tensorclass" else whole


def cmd_save(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Every case as its own step (the last one through save_async)."""
    for step, case in STEPS.items():
        shard = shard_of(case, world, rank)
        if step == max(STEPS):
            mgr.save_async(step, shard, replicated=replicated_of(case)).result()
        else:
            mgr.save(step, shard, replicated=replicated_of(case), metadata={"case": case})
    return mgr.steps()


def cmd_restore(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Each rank's even part, a slice crossing the shard border, and restore_into."""
    from _shard_compare import assert_same

    from tdckpt._shard.rows import even_part

    total = sum(LENGTHS[world])
    out = []
    for step, case in STEPS.items():
        whole = reference(case, total)
        start, stop = even_part(total, rank, world)
        got = mgr.restore(step, verify=True)
        assert_same(got, whole[start:stop], f"{case} rank {rank}")
        lo, hi = 2, total - 2
        assert_same(mgr.restore(step, rows=slice(lo, hi)), whole[lo:hi], f"{case} rows")
        take = [3, 5][rank]
        target = reference(case, take)  # same structure, other values
        mgr.restore_into(target, step)
        off = sum([3, 5][:rank])
        assert_same(target, whole[off : off + take], f"restore_into {case} rank {rank}")
        out.append(step)
    return out


def cmd_views(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """Rows inside one shard are views of that shard's one mapping (no copy)."""
    from tensordict import MemoryMappedTensor

    lo, hi = args["rows"]
    got = mgr.restore(1, rows=slice(lo, hi))
    leaves = [v for v in got.values(True, True) if isinstance(v, torch.Tensor)]
    storages = {v.untyped_storage().data_ptr() for v in leaves}
    return {
        "mapped": all(isinstance(v, MemoryMappedTensor) for v in leaves),
        "storages": len(storages),
        "leaves": len(leaves),
        "rows": int(got.batch_size[0]),
    }


def cmd_tampered(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """restore_into of a tampered step: every rank raises, no target is touched."""
    target = make_case("nested", [3, 5][rank])
    before = target.clone()
    raised: list[str] | None = None
    try:
        mgr.restore_into(target, 1, verify=args.get("verify", False))
    except Exception as exc:
        raised = [type(exc).__name__, str(exc)]
    untouched = all(torch.equal(target[k], before[k]) for k in before.keys(True, True))
    return {"raised": raised, "untouched": untouched}


def cmd_incremental(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> Any:
    """A consolidated collective manager refuses incremental saves, on every rank."""
    try:
        mgr.save(9, shard_of("nested", world, rank), incremental=True)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None
