"""Rank-side commands for tests/test_sharded_split_check.py (run by _shard_child.spawn_ranks).

Each rank restores step 1 of ``args["root"]`` (a sharded step the test wrote) with its
collective manager, whole and in place, recording which shard folders this rank opened to
check (``tdckpt._shard.check._open``) and what each call returned or raised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict


def _outcome(call: Any) -> list[Any]:
    try:
        value = call()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return ["returned", value]


def cmd_restore(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    from tdckpt._shard import check

    opened: list[list[str]] = []
    real_open = check._open

    def counting_open(folder: Path, hold: bool) -> Any:
        opened[-1].append(folder.name)
        return real_open(folder, hold)

    check._open = counting_open  # type: ignore[assignment]
    try:
        opened.append([])
        restore = _outcome(lambda: mgr.restore(1)["x"].tolist())
        rows = args["rows"][rank]
        target = TensorDict(x=torch.full((rows,), -1.0), batch_size=[rows])
        opened.append([])
        into = _outcome(lambda: mgr.restore_into(target, 1)["x"].tolist())
        untouched = bool((target["x"] == -1).all()) if into[0] != "returned" else None
    finally:
        check._open = real_open  # type: ignore[assignment]
    return {"opened": opened, "restore": restore, "restore_into": into, "untouched": untouched}


def cmd_gather(mgr: Any, rank: int, world: int, args: dict[str, Any]) -> list[Any]:
    """all_gather of objects around the one-round limit, of every size on each rank."""
    from tdckpt._shard.group import INLINE_BYTES

    group = mgr._shard
    out = []
    for size in (0, 1, INLINE_BYTES - 64, INLINE_BYTES, INLINE_BYTES + 1, 3 * INLINE_BYTES):
        mine = ("x" * (size if rank == 1 else 1), rank, None)
        out.append(group.all_gather(mine, f"gather {size}"))
    return out
