"""Training-state benchmark: a ~50M-parameter model + Adam state, saved and restored.

    python benchmarks/run.py state [--quick]

Rows, each against its baseline measured in the same run (best of several runs; ratios
< 1 mean tdckpt is faster):

* save: ``CheckpointManager.save(step, {"model": model, "optim": optimizer})`` (CRC-32
  checksums and fsync on) vs ``torch.save({"model": model.state_dict(), "optim":
  optimizer.state_dict()}, f)`` followed by an fsync of that file (equal durability), and
  vs ``torch.distributed.checkpoint.save`` (single process) of the same state.
* restore: ``CheckpointManager.restore_into({"model": ..., "optim": ...})`` (every entry
  checked first) vs a page-cache-hot ``torch.load`` of that file (the target: <= 0.5x),
  vs ``torch.load`` + ``load_state_dict`` into the live objects (what the user runs
  instead), and vs ``torch.distributed.checkpoint.load`` + ``set_state_dict``.
* restore + read: the same restores followed by one read of every restored byte, since
  tdckpt maps the step (copy-on-write) and pays its page faults on first touch.

Every timed save starts after the previous round's outputs are deleted and ``os.sync()``
returned, so no save pays for another's deletions or leftover writeback.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tdckpt


def _best(func: Callable[[], Any], reps: int, before: Callable[[], Any] | None = None) -> float:
    best = float("inf")
    for _ in range(reps):
        if before is not None:
            before()
        gc.collect()
        start = time.perf_counter()
        func()
        best = min(best, time.perf_counter() - start)
    return best


def _best_interleaved(
    funcs: list[Callable[[], Any]], reps: int, before: Callable[[], Any] | None = None
) -> list[float]:
    """Best time of each function, their runs interleaved (a loaded machine drifts)."""
    best = [float("inf")] * len(funcs)
    for _ in range(reps):
        for i, func in enumerate(funcs):
            if before is not None:
                before()
            gc.collect()
            start = time.perf_counter()
            func()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _row(label: str, base_name: str, base: float, ours: float) -> None:
    print(
        f"  {label:<34} {base_name:<34} {base * 1e3:9.1f} ms   tdckpt {ours * 1e3:9.1f} ms"
        f"   ratio {ours / base:5.2f}"
    )


def _model(width: int, depth: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))


def _state(width: int, depth: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(width, depth, seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # Adam's moments exist: 3x the parameters in all
    opt.zero_grad(set_to_none=True)
    return model, opt


def _touch(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    total = 0.0
    with torch.no_grad():
        for p in model.parameters():
            total += float(p.sum())
            for v in opt.state[p].values():
                total += float(v.sum())
    return total


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench(work: Path, quick: bool) -> None:
    width, depth = (1024, 5) if quick else (2048, 12)  # ~5M or ~50M parameters
    reps = 2 if quick else 5
    model, opt = _state(width, depth, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    nbytes = 3 * 4 * n_params
    print(
        f"state: {n_params / 1e6:.1f}M-parameter model + Adam state "
        f"({nbytes / 2**20:.0f} MiB), best of {reps} (runs interleaved)"
    )
    print("  (a shared machine: other processes run too; compare ratios, not absolutes)")

    # -- save ---------------------------------------------------------------------------
    ptfile = work / "state.pt"

    def torch_save() -> None:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, ptfile)
        _fsync_file(ptfile)

    root = work / "root"
    step = [0]

    def ours_save() -> None:
        step[0] += 1
        mgr.save(step[0], {"model": model, "optim": opt})

    def clear_root() -> None:
        for p in root.glob("[0-9]*"):
            shutil.rmtree(p)
        ptfile.unlink(missing_ok=True)

    dcp_dir = work / "dcp"

    def dcp_save() -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(dcp_dir))

    def clear_dcp() -> None:
        shutil.rmtree(dcp_dir, ignore_errors=True)

    def clear_all() -> None:
        # Every save starts from the same disk state: the outputs of the previous round are
        # deleted, and os.sync() makes the deletions (journal commit, discards) and any
        # leftover writeback happen now, untimed, instead of inside the next timed save's
        # fsync - the baseline and tdckpt alike.
        clear_root()
        clear_dcp()
        os.sync()

    with tdckpt.CheckpointManager(root, retention=tdckpt.KeepLast(1)) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
            t_torch_save, t_ours_save, t_dcp_save = _best_interleaved(
                [torch_save, ours_save, dcp_save], reps, clear_all
            )
        _row("save (checksums + fsync)", "torch.save + fsync", t_torch_save, t_ours_save)
        _row(
            "save (checksums + fsync)", "torch.distributed.checkpoint.save", t_dcp_save, t_ours_save
        )

        # -- restore ----------------------------------------------------------------------
        torch_save()
        mgr.save(step[0] + 1, {"model": model, "optim": opt})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_save()
        target_model, target_opt = _state(width, depth, seed=1)
        target = {"model": target_model, "optim": target_opt}

        def torch_load() -> Any:
            return torch.load(ptfile, weights_only=True)

        def torch_load_into() -> None:
            sd = torch.load(ptfile, weights_only=True)
            target_model.load_state_dict(sd["model"])
            target_opt.load_state_dict(sd["optim"])

        def ours_restore() -> None:
            mgr.restore_into(target)

        def dcp_load() -> None:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, optim_sd = get_state_dict(target_model, target_opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(dcp_dir))
            set_state_dict(
                target_model,
                target_opt,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )

        torch_load()  # page cache hot for every baseline and for tdckpt alike
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t_load, t_load_into, t_ours, t_dcp_load = _best_interleaved(
                [torch_load, torch_load_into, ours_restore, dcp_load], reps
            )
        _row("restore_into (checked)", "torch.load (page cache hot)", t_load, t_ours)
        _row("restore_into (checked)", "torch.load + load_state_dict", t_load_into, t_ours)
        _row("restore_into (checked)", "dcp.load + set_state_dict", t_dcp_load, t_ours)

        def torch_then_read() -> None:
            torch_load_into()
            _touch(target_model, target_opt)

        def ours_then_read() -> None:
            ours_restore()
            _touch(target_model, target_opt)

        t_torch_read, t_ours_read = _best_interleaved([torch_then_read, ours_then_read], reps)
        _row(
            "restore_into + read every byte",
            "torch.load + load_state_dict + read",
            t_torch_read,
            t_ours_read,
        )
        # Sanity: what was restored is what was saved.
        for a, b in zip(model.parameters(), target_model.parameters(), strict=True):
            assert torch.equal(a, b)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tdckpt-bench-") as tmp:
        bench(Path(tmp), "--quick" in sys.argv)
