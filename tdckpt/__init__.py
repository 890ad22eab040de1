"""tdckpt: make any TensorDict checkpoint restorable, safely and in place.

Restore (any tensordict release, validated, all or nothing)::

    tdckpt.load_memmap_(td, prefix, robust_key=None, allow_pickle=False)
    td = tdckpt.load_memmap(prefix)
    tdckpt.validate(prefix); tdckpt.inspect(prefix); tdckpt.upgrade(prefix, dry_run=True)
    tdckpt.diff(prefix_a, prefix_b)  # what changed, key by key
    tdckpt.export_safetensors(prefix, out); tdckpt.load_safetensors(out)

Manage a run's checkpoints::

    with tdckpt.CheckpointManager("runs/exp1", retention=tdckpt.KeepLast(3)) as mgr:
        mgr.save(step, td, metadata={"loss": loss})
        mgr.restore_into(td)

Decide when to save (and save on preemption)::

    policy = tdckpt.SaveEvery(1000) | tdckpt.SaveOnPreemption()
    with tdckpt.CheckpointManager("runs/exp1", save_policy=policy) as mgr:
        if mgr.should_save(step):
            mgr.save_async(step, td)
"""

from tdckpt._interop.safetensors import ExportReport, export_safetensors, load_safetensors
from tdckpt._read.diff import DiffEntry, DiffReport, diff
from tdckpt._read.inspect import inspect, validate
from tdckpt._report import Inspection, NodeInfo, Problem, ValidationReport
from tdckpt._restore.engine import load_memmap, load_memmap_
from tdckpt._restore.select import RestoreReport
from tdckpt._state.rng import RandomState
from tdckpt._upgrade.upgrade import UpgradeReport, upgrade
from tdckpt._version import __version__
from tdckpt._write.export import save
from tdckpt.manager import CheckpointManager, StepStatus, VerifyProblem, VerifyReport
from tdckpt.retention import (
    AnyOf,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepEverySeconds,
    KeepLast,
    KeepYoungerThan,
    RetentionPolicy,
    StepInfo,
)
from tdckpt.save_policy import (
    SaveAnyOf,
    SaveAtSteps,
    SaveContext,
    SaveEvery,
    SaveEverySeconds,
    SaveFirst,
    SaveOnPreemption,
    SavePolicy,
)

__all__ = [
    "AnyOf",
    "CheckpointManager",
    "DiffEntry",
    "DiffReport",
    "ExportReport",
    "Inspection",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepEverySeconds",
    "KeepLast",
    "KeepYoungerThan",
    "NodeInfo",
    "Problem",
    "RandomState",
    "RestoreReport",
    "RetentionPolicy",
    "SaveAnyOf",
    "SaveAtSteps",
    "SaveContext",
    "SaveEvery",
    "SaveEverySeconds",
    "SaveFirst",
    "SaveOnPreemption",
    "SavePolicy",
    "StepInfo",
    "StepStatus",
    "UpgradeReport",
    "ValidationReport",
    "VerifyProblem",
    "VerifyReport",
    "__version__",
    "diff",
    "export_safetensors",
    "inspect",
    "load_memmap",
    "load_memmap_",
    "load_safetensors",
    "save",
    "upgrade",
    "validate",
]
