"""Restore a training state in place: every entry checked first, all or nothing across entries.

:func:`restore_state` runs in two phases:

1. **Check.** The step is loaded (leaves memory-mapped, nothing copied) and every entry of
   the target is compared with what the step holds: its kind (module, optimizer, ...), and
   for a module its state-dict keys, shapes, dtypes and tied parameters; for an optimizer
   its class, parameter groups and the shape and dtype of every parameter; for a scheduler
   or any other object the keys and tensor shapes of its ``state_dict()``. The values too,
   against what each live object can use (:mod:`tdckpt._state.check`: optimizer state
   tensors against their parameters, group hyperparameters and scheduler values by kind
   and range; :meth:`RandomState._check <tdckpt.RandomState>` for the generators), and the
   saved structure against the encoder's budgets
   (:mod:`tdckpt._read.state_structure`). Every mismatch of every entry is reported in one
   :class:`~tdckpt.errors.RestoreError`, and nothing has been changed.
2. **Apply**, entry by entry, each with a way back. Should one fail anyway (a hook raising,
   memory running out), the entries already restored are put back as they were and the
   error is raised.

A module whose loading is torch's own (no ``_load_from_state_dict`` override other than
batch norm's, no load hooks, no extra state) is restored without copying: each parameter
and buffer keeps its identity - optimizers keep referring to them, tied ones stay tied -
and takes the step's memory-mapped tensor as its data (``param.data = ...``), moved to the
parameter's device when it lives elsewhere. Any other module goes through
``load_state_dict(strict=True)``. Parameters on the ``meta`` device are replaced by new
ones on ``device`` (tied ones by one shared parameter): build the optimizer after such a
restore and restore it in a second call (an optimizer over the meta parameters, restored in
the same call, would keep the discarded ones: it is refused).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tdckpt._state.check import optimizer_problems, scheduler_problems
from tdckpt._state.decode import saved_structure
from tdckpt._state.encode import entry_kind, param_signature, type_name
from tdckpt.errors import RestoreError
from tdckpt.schema import StateRecord

__all__ = ["compare_structure", "restore_state"]

#: Lazy modules' parameters and buffers before their first forward (shapes not yet known).
_UNINITIALIZED: type = torch.nn.parameter.UninitializedTensorMixin  # type: ignore[attr-defined]


# -- checking ---------------------------------------------------------------------------------


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def compare_structure(
    live: Any, saved: Any, path: str, problems: list[str], depth: int = 0
) -> None:
    """Append to ``problems`` where ``saved`` cannot stand in for ``live``: the keys of
    str-keyed dicts, and tensor shapes and dtypes, where both sides have them (a
    ``state_dict`` against a saved one; TorchRL's adapter checks a component so too)."""
    if depth > 50:
        return
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        if live.shape != saved.shape or live.dtype != saved.dtype:
            problems.append(
                f"{path or 'the value'}: the target has {_describe(live)}, "
                f"the step {_describe(saved)}"
            )
        return
    if isinstance(live, dict) and isinstance(saved, dict):
        if not all(type(k) is str for k in (*live, *saved)):
            return
        missing = [k for k in live if k not in saved]
        unexpected = [k for k in saved if k not in live]
        if missing:
            problems.append(f"{path or 'state_dict'}: keys the step lacks: {_list(missing)}")
        if unexpected:
            problems.append(f"{path or 'state_dict'}: keys the target lacks: {_list(unexpected)}")
        for k in live:
            if k in saved:
                compare_structure(
                    live[k], saved[k], f"{path}.{k}" if path else k, problems, depth + 1
                )


def _list(keys: list[Any], limit: int = 10) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


@dataclass
class _Action:
    """One entry's restore: ``apply`` it, ``undo`` it (put the object back as it was)."""

    name: str
    apply: Callable[[], None]
    undo: Callable[[], None]


def _load_action(
    name: str, snapshot: Callable[[], Any], load: Callable[[Any], Any], state: Any
) -> _Action:
    """``apply``: keep ``snapshot()`` (the object as it is), then ``load(state)``;
    ``undo``: ``load`` what was kept."""
    before: list[Any] = []

    def apply() -> None:
        before.append(snapshot())
        load(state)

    def undo() -> None:
        if before:
            load(before[0])

    return _Action(name, apply, undo)


# -- modules ----------------------------------------------------------------------------------


def _plain_loading(module: torch.nn.Module) -> bool:
    """Whether loading ``module`` is exactly torch's default, parameter by parameter."""
    from torch.nn.modules.batchnorm import _NormBase

    if type(module).load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    if type(module)._load_from_state_dict is not torch.nn.Module._load_from_state_dict:
        return False  # the root module's own override is not batch norm's exception below
    allowed = (torch.nn.Module._load_from_state_dict, _NormBase._load_from_state_dict)
    for sub in module.modules():
        cls = type(sub)
        if cls._load_from_state_dict not in allowed:
            return False
        if cls.get_extra_state is not torch.nn.Module.get_extra_state:
            return False
        if cls.set_extra_state is not torch.nn.Module.set_extra_state:
            return False
        if sub._load_state_dict_pre_hooks or sub._load_state_dict_post_hooks:
            return False
        if any(
            isinstance(p, _UNINITIALIZED)
            for p in (*sub._parameters.values(), *sub._buffers.values())
        ):
            return False
    return True


def _module_action(
    name: str,
    module: torch.nn.Module,
    saved: dict[str, Any],
    device: torch.device | None,
    problems: list[str],
) -> _Action | None:
    state = saved["state_dict"]
    where = f"entry {name!r} (a {type(module).__name__})"
    if not isinstance(state, dict):
        problems.append(f"{where}: the step's state_dict is not a dict")
        return None
    odd = [k for k in state if type(k) is not str]
    if odd:  # a module's state-dict keys are names
        problems.append(
            f"{where}: the step's state_dict has keys that are not names: {odd[:5]!r:.100}"
        )
        return None
    live = module.state_dict()
    missing = [k for k in live if k not in state]
    unexpected = [k for k in state if k not in live]
    if missing:
        problems.append(f"{where}: keys the step lacks: {_list(missing)}")
    if unexpected:
        problems.append(f"{where}: keys the target lacks: {_list(unexpected)}")
    for key, value in live.items():
        if key not in state:
            continue
        saved_value = state[key]
        if isinstance(value, torch.Tensor) != isinstance(saved_value, torch.Tensor):
            problems.append(
                f"{where}: {key!r} is a {type(value).__name__} in the target, a "
                f"{type(saved_value).__name__} in the step"
            )
        elif (
            isinstance(value, torch.Tensor)
            and not isinstance(value, _UNINITIALIZED)
            and (value.shape != saved_value.shape or value.dtype != saved_value.dtype)
        ):
            problems.append(
                f"{where}: {key!r} is {_describe(value)} in the target, "
                f"{_describe(saved_value)} in the step"
            )
    # Tied in the target: the step must store one tensor for all of those names.
    groups: dict[int, list[str]] = {}
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for key, tensor in named:
        if key in state:
            groups.setdefault(id(tensor), []).append(key)
    for keys in groups.values():
        if len(keys) > 1 and any(state[k] is not state[keys[0]] for k in keys[1:]):
            problems.append(
                f"{where}: the target ties {_list(keys)} (one parameter), the step stores "
                "them as different tensors"
            )
    # Tied in the step but not in the target: each gets a copy (through load_state_dict).
    group_of = {key: gid for gid, keys in groups.items() for key in keys}
    first_of: dict[int, str] = {}
    saved_tied = False
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            first = first_of.setdefault(id(value), key)
            if first != key and group_of.get(first, first) != group_of.get(key, key):
                saved_tied = True
    if problems:
        return None

    fast = _plain_loading(module) and not saved_tied
    if fast:
        return _swap_action(name, module, named, state, device)
    on_meta = any(t.device.type == "meta" for _, t in named)
    target_device = device if device is not None else torch.device("cpu")
    if on_meta:
        to_load: Any = type(state)(
            (k, v.to(target_device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
        )
        if hasattr(state, "_metadata"):
            to_load._metadata = state._metadata
    else:
        to_load = state
    before: dict[str, Any] = {}
    # A lazy module's parameters before its first forward pass: torch's load materializes
    # them in place (their class and data change); put back, they are uninitialized again.
    lazy = [(t, type(t), t.dtype, t.device) for _, t in named if isinstance(t, _UNINITIALIZED)]

    def apply() -> None:
        before.update(
            (k, v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
            for k, v in module.state_dict().items()
            if not isinstance(v, _UNINITIALIZED)  # nothing to keep: put back as they were
        )
        module.load_state_dict(to_load, strict=True, assign=on_meta)

    def undo() -> None:
        if before:
            module.load_state_dict(before, strict=False, assign=on_meta)
        for tensor, cls, dtype, where in lazy:
            if type(tensor) is not cls:
                tensor.data = torch.empty(0, dtype=dtype, device=where)
                tensor.__class__ = cls

    return _Action(name, apply, undo)


def _swap_action(
    name: str,
    module: torch.nn.Module,
    named: list[tuple[str, torch.Tensor]],
    state: dict[str, Any],
    device: torch.device | None,
) -> _Action:
    """Give every parameter and buffer the step's tensor as its data (no copy on its device)."""
    moved: dict[tuple[int, str], torch.Tensor] = {}
    swaps: list[tuple[torch.Tensor, torch.Tensor]] = []
    replaced: list[tuple[dict[str, Any], str, Any]] = []

    def value_for(key: str, where: torch.device) -> torch.Tensor:
        source = state[key]
        cached = moved.get((id(source), str(where)))
        if cached is None:
            cached = source if source.device == where else source.to(where)
            moved[(id(source), str(where))] = cached
        return cached

    def apply() -> None:
        done: set[int] = set()
        new_params: dict[int, torch.nn.Parameter] = {}
        for key, tensor in named:
            if key not in state or id(tensor) in done:
                continue
            done.add(id(tensor))
            if tensor.device.type == "meta":
                # set_data cannot leave the meta device: a new parameter (or buffer) takes
                # the old one's place in every module holding it (ties stay one object).
                where = device if device is not None else torch.device("cpu")
                value = value_for(key, where)
                for owner_key, owner_tensor in named:
                    if owner_tensor is not tensor:
                        continue
                    owner_name, _, attr = owner_key.rpartition(".")
                    owner = module.get_submodule(owner_name)
                    store = owner._parameters if attr in owner._parameters else owner._buffers
                    if isinstance(tensor, torch.nn.Parameter):
                        new = new_params.get(id(tensor))
                        if new is None:
                            new = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
                            new_params[id(tensor)] = new
                        replaced.append((store, attr, store[attr]))
                        store[attr] = new
                    else:
                        replaced.append((store, attr, store[attr]))
                        store[attr] = value  # type: ignore[assignment]
                continue
            value = value_for(key, tensor.device)
            swaps.append((tensor, tensor.data))
            tensor.data = value

    def undo() -> None:
        for tensor, old in reversed(swaps):
            tensor.data = old
        for store, attr, old in reversed(replaced):
            store[attr] = old
        swaps.clear()
        replaced.clear()

    return _Action(name, apply, undo)


# -- optimizers, schedulers, generators, anything stateful -----------------------------------


def _stateful_action(
    name: str,
    target: Any,
    kind: str,
    saved: dict[str, Any],
    saved_type: str,
    problems: list[str],
) -> _Action | None:
    where = f"entry {name!r} (a {type(target).__name__})"
    state = saved["state_dict"]
    if kind in ("optimizer", "scheduler") and saved_type != type_name(target):
        problems.append(f"{where}: the step holds the state of a {saved_type.replace(':', '.')}")
        return None
    mine: list[str] = []
    if kind == "rng":
        try:
            target._check(state)
        except ValueError as exc:
            mine.append(str(exc))
    elif kind == "optimizer":
        mine = optimizer_problems(target, state, param_signature(target), saved.get("params"))
    else:
        live = target.state_dict()
        compare_structure(live, state, "", mine)
        if kind == "scheduler" and not mine:
            mine += scheduler_problems(live, state)
    problems.extend(f"{where}: {p}" for p in mine)
    if mine:
        return None
    if kind == "optimizer":
        # the snapshot holds references: loading replaces the state, never writes into it
        return _load_action(name, target.state_dict, target.load_state_dict, state)
    return _load_action(
        name, lambda: copy.deepcopy(target.state_dict()), target.load_state_dict, state
    )


def _tensordict_action(name: str, target: Any, saved: Any, problems: list[str]) -> _Action | None:
    where = f"entry {name!r} (a {type(target).__name__})"
    live_keys = set(target.keys(include_nested=True, leaves_only=True))
    saved_keys = set(saved.keys(include_nested=True, leaves_only=True))
    if live_keys != saved_keys:
        missing = sorted(map(str, live_keys - saved_keys))
        unexpected = sorted(map(str, saved_keys - live_keys))
        if missing:
            problems.append(f"{where}: keys the step lacks: {_list(missing)}")
        if unexpected:
            problems.append(f"{where}: keys the target lacks: {_list(unexpected)}")
    for key in sorted(live_keys & saved_keys, key=str):
        mine, theirs = target.get(key), saved.get(key)
        if (
            isinstance(mine, torch.Tensor)
            and isinstance(theirs, torch.Tensor)
            and (mine.shape != theirs.shape or mine.dtype != theirs.dtype)
        ):
            problems.append(
                f"{where}: {key!r} is {_describe(mine)} in the target, {_describe(theirs)} "
                "in the step"
            )
    if tuple(target.batch_size) != tuple(saved.batch_size):
        problems.append(
            f"{where}: batch size {list(target.batch_size)} in the target, "
            f"{list(saved.batch_size)} in the step"
        )
    if target.is_locked:
        problems.append(f"{where}: the target is locked; unlock it first")
    if problems:
        return None
    return _load_action(name, target.copy, target.update, saved)


# -- the whole state ------------------------------------------------------------------------


def _meta_optimizer_problems(state: Mapping[str, Any]) -> list[str]:
    """An optimizer of the state that optimizes a module's ``meta`` parameters: the restore
    replaces those with new parameters, which the optimizer would never see (it would keep
    stepping the discarded ones while training changes nothing)."""
    owners: dict[int, str] = {}
    for name, target in state.items():
        if isinstance(target, torch.nn.Module):
            for param in target.parameters():
                if param.device.type == "meta":
                    owners[id(param)] = str(name)
    if not owners:
        return []
    problems = []
    for name, target in state.items():
        if not isinstance(target, torch.optim.Optimizer):
            continue
        modules = sorted(
            {
                owners[id(p)]
                for group in target.param_groups
                for p in group["params"]
                if id(p) in owners
            }
        )
        if modules:
            problems.append(
                f"entry {name!r}: it optimizes parameters of {_list(modules)} on the meta "
                "device, which this restore replaces with new parameters that it would never "
                "see. Restore the modules first, then build the optimizer over their new "
                "parameters and restore it in a second call."
            )
    return problems


def restore_state(
    state: Mapping[str, Any],
    loaded: Any,
    record: StateRecord | None,
    *,
    where: str,
    strict: bool = True,
    device: torch.device | str | None = None,
) -> None:
    """Restore every entry of ``state`` from ``loaded`` (the step, as a TensorDict).

    Args:
        state: names -> live objects, as given to ``save``.
        loaded: the step, loaded (memory-mapped) by the restore engine.
        record: the manifest's state record (None: the step is not a training state).
        where: the step's path and number, for messages.
        strict: the step's entries and the target's must be the same names; with False
            the step may hold more entries than the target (only the target's are
            restored). Within an entry the check is always strict.
        device: where tensors without a device of their own go (parameters on ``meta``).

    Raises:
        RestoreError: naming every mismatch of every entry (nothing changed), or the error
            of an entry that failed while restoring (the entries before it put back).
    """
    dev = torch.device(device) if device is not None else None
    if record is None:
        raise RestoreError(
            f"{where}: was saved from a TensorDict, not a training state (a mapping of "
            "names to modules, optimizers, ...); nothing was changed. Restore it into a "
            "TensorDict, or use restore() for a new object.",
        )
    problems: list[str] = _meta_optimizer_problems(state)
    actions: list[_Action] = []
    for name, target in state.items():
        entry = record.entries.get(name) if isinstance(name, str) else None
        kind = entry_kind(target)
        if entry is None:
            problems.append(
                f"entry {name!r}: not in the step (it holds {_list(list(record.entries))})"
            )
            continue
        if kind is None:
            problems.append(f"entry {name!r}: a {type(target).__name__} cannot be restored into")
            continue
        compatible = kind == entry.kind or (
            (kind == "stateful" or entry.kind == "stateful")
            and (kind != "tensordict" and entry.kind != "tensordict")
        )
        if not compatible:
            problems.append(
                f"entry {name!r}: the target is a {kind} ({type(target).__name__}), the step "
                f"holds a {entry.kind} ({entry.type.replace(':', '.')})"
            )
            continue
        entry_td = loaded.get(name)
        if kind == "tensordict":
            action = _tensordict_action(name, target, entry_td, problems)
        else:
            try:
                # an optimizer's state never shares a tensor between two of its values
                saved = saved_structure(entry_td, f"entry {name!r}", aliases=kind != "optimizer")
            except RestoreError as exc:  # damaged: reported with every other entry's problems
                problems.append(str(exc))
                continue
            if kind == "module":
                action = _module_action(name, target, saved, dev, problems)
            else:
                action = _stateful_action(name, target, kind, saved, entry.type, problems)
        if action is not None:
            actions.append(action)
    if strict:
        extra = [n for n in record.entries if n not in state]
        if extra:
            problems.append(
                f"the step holds entries the target lacks: {_list(extra)} (pass strict=False "
                "to restore only the target's entries)"
            )
    if problems:
        raise RestoreError(
            f"{where}: the target does not match the step; nothing was changed.\n  "
            + "\n  ".join(problems),
            problems=problems,
        )
    done: list[_Action] = []
    for action in actions:
        try:
            action.apply()
        except BaseException as exc:
            failed_undo = []
            for earlier in reversed([*done, action]):
                try:
                    earlier.undo()
                except Exception:  # keep putting the others back
                    failed_undo.append(earlier.name)
            note = f"; these could not be put back: {_list(failed_undo)}" if failed_undo else ""
            restored = _list([a.name for a in done]) if done else "none"
            if not isinstance(exc, Exception):
                raise
            raise RestoreError(
                f"{where}: restoring entry {action.name!r} failed ({type(exc).__name__}: "
                f"{exc}); the entries restored before it ({restored}) "
                f"were put back as they were{note}.",
                entry=action.name,
            ) from exc
        done.append(action)
