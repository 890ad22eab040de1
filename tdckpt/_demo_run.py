"""``tdckpt demo``: the main job on a small built-in example.

1. Restores a checkpoint written by tensordict 0.3.2 (bundled in ``tdckpt/_demo``) that
   tensordict 0.15.3 itself reloads with two of its three sub-trees silently missing.
2. Runs a tiny training loop with a :class:`~tdckpt.CheckpointManager`: saves every few
   steps, keeps the last three, then resumes into a fresh tensordict with ``restore_into``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

DEMO_DIR = Path(__file__).parent / "_demo"
LEGACY = DEMO_DIR / "tensordict-0.3.2-nested"


def _leaves(obj: object, prefix: str = "") -> list[str]:
    out = []
    items = obj.items() if isinstance(obj, dict) else obj.items(include_nested=False)  # type: ignore[attr-defined]
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out.append(f"{name}: {str(value.dtype).removeprefix('torch.')} {list(value.shape)}")
        else:
            out.extend(_leaves(value, name + "."))
    return out


def run_demo() -> int:
    import tdckpt
    from tdckpt.retention import KeepLast

    print(f"1) A checkpoint written by tensordict 0.3.2: {LEGACY}")
    info = tdckpt.inspect(LEGACY)
    print(
        f"   generation {info.generation}, key encoding {info.key_encoding}, "
        f"{info.leaf_count} leaves, {info.total_bytes} bytes"
    )
    if info.migrations:
        print(f"   migrated in memory through: {', '.join(info.migrations)}")
    restored = tdckpt.load_memmap(LEGACY, robust_key=None, allow_pickle=False)
    print(f"   restored a {type(restored).__name__} with batch size {list(restored.batch_size)}:")
    for line in _leaves(restored):
        print(f"     {line}")

    print("2) A training loop with CheckpointManager (save every 10 steps, keep the last 3)")
    with tempfile.TemporaryDirectory() as root:
        from tensordict import TensorDict

        state = TensorDict(
            params=TensorDict(w=torch.zeros(4, 4), b=torch.zeros(4)),
            optim=TensorDict(step=torch.zeros((), dtype=torch.int64)),
        )
        with tdckpt.CheckpointManager(root, retention=KeepLast(3)) as mgr:
            for step in range(1, 51):
                state["params", "w"] += 0.01
                state["optim", "step"] += 1
                if step % 10 == 0:
                    mgr.save(step, state, metadata={"loss": round(1.0 / step, 4)})
            print(f"   committed steps: {mgr.steps()} (latest {mgr.latest_step()})")
            resumed = TensorDict(
                params=TensorDict(w=torch.empty(4, 4), b=torch.empty(4)),
                optim=TensorDict(step=torch.empty((), dtype=torch.int64)),
            )
            mgr.restore_into(resumed)
            ok = bool((resumed["params", "w"] == state["params", "w"]).all())
            print(f"   resumed at step {int(resumed['optim', 'step'])}; weights match: {ok}")
            report = mgr.verify()
            print(f"   verify latest step: {'ok' if report.ok else 'DAMAGED'}")
    return 0 if ok and report.ok else 1
