"""What a live optimizer or LR scheduler accepts, checked before its ``load_state_dict``.

torch's own ``load_state_dict`` takes nearly anything and the damage shows at the next
training step: a moment whose shape is not its parameter's, ``lr = "fast"``, a
``last_epoch`` of ``"abc"``. These functions compare a saved state with the live object and
return one message per problem (empty: it may be loaded), so that the restore refuses all of
them at once before the first object is touched.

* Values are compared with what the live object holds now: a number stays a number (an int
  may become a float and back, never a bool or a str), a bool stays a bool, a str a str, a
  tuple keeps its length and the types of its items, a tensor its shape; integers stay
  within 64 bits, numbers are not NaN.
* An optimizer's parameter groups keep their parameter counts and signature (the shape and
  dtype of every parameter, recorded at save time), every hyperparameter the live group has
  as a number or tuple, and the ranges torch's constructors check (``lr >= 0``, betas in
  ``[0, 1)``, ...). Its per-parameter state refers only to saved parameters, and every
  tensor in it that is a moment of its parameter has the parameter's shape and a floating
  dtype; where the live optimizer already holds state for the parameter, the saved state
  has the same keys, the same kinds of values and the same shapes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["optimizer_problems", "scheduler_problems", "value_problems"]

#: Integers a restored value may hold where the live object holds an int.
_INT_LIMIT = 2**63
#: Hyperparameters torch's optimizers require to be >= 0 (and finite).
_NON_NEGATIVE = frozenset(
    {
        "lr",
        "eps",
        "weight_decay",
        "momentum",
        "dampening",
        "alpha",
        "lr_decay",
        "initial_accumulator_value",
        "rho",
        "lambd",
        "t0",
        "momentum_decay",
    }
)
#: Hyperparameter tuples whose items torch requires in [0, 1).
_UNIT_TUPLES = frozenset({"betas"})
#: Per-parameter state entries shaped like their parameter (torch's built-in optimizers).
_PARAM_SHAPED = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "square_avg",
        "acc_delta",
        "grad_avg",
        "sum",
        "ax",
        "prev",
        "step_size",
        "exp_inf",
    }
)

#: The entries a non-empty per-parameter state of torch's optimizers always holds (a state
#: lacking one fails with a KeyError at the next step).
_REQUIRED: dict[str, frozenset[str]] = {
    "Adam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "AdamW": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "NAdam": frozenset({"step", "exp_avg", "exp_avg_sq", "mu_product"}),
    "RAdam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "Adamax": frozenset({"step", "exp_avg", "exp_inf"}),
    "Adagrad": frozenset({"step", "sum"}),
    "RMSprop": frozenset({"step", "square_avg"}),
    "Adadelta": frozenset({"step", "square_avg", "acc_delta"}),
    "ASGD": frozenset({"step", "eta", "mu", "ax"}),
    "Rprop": frozenset({"step", "prev", "step_size"}),
}


def _required(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> frozenset[str]:
    cls = type(optimizer)
    if getattr(torch.optim, cls.__name__, None) is not cls:
        return frozenset()  # not one of torch's: its state is its own
    keys = _REQUIRED.get(cls.__name__, frozenset())
    if group.get("amsgrad") is True and "exp_avg_sq" in keys:
        keys |= {"max_exp_avg_sq"}
    return keys


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')}{list(value.shape)} tensor"
    if type(value) is int and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return f"{value!r:.60}"


def value_problems(live: Any, saved: Any, path: str, *, depth: int = 0) -> list[str]:
    """Where ``saved`` is not the kind of value ``live`` is (see the module docstring)."""
    if depth > 100:
        return []
    if live is None or (callable(live) and not isinstance(live, torch.Tensor)):
        return []  # nothing to compare with (not set yet, or code the state cannot hold)
    if isinstance(live, torch.Tensor):
        if isinstance(saved, torch.Tensor):
            if live.shape != saved.shape:
                return [f"{path} is {_show(saved)}, the target holds {_show(live)}"]
            return []
        if live.numel() == 1 and _number(saved):
            return value_problems(live.item(), saved, path, depth=depth)
        return [f"{path} is {_show(saved)}, the target holds {_show(live)}"]
    if type(live) is bool:
        return [] if type(saved) is bool else [f"{path} is {_show(saved)}, expected a bool"]
    if _number(live):
        if isinstance(saved, torch.Tensor) and saved.numel() == 1 and not saved.is_complex():
            saved = saved.item()
        if not _number(saved):
            return [f"{path} is {_show(saved)}, expected a number (the target holds {live!r})"]
        if type(saved) is float and math.isnan(saved):
            return [f"{path} is nan, expected a number"]
        if type(saved) is int and not -_INT_LIMIT <= saved < _INT_LIMIT:
            return [f"{path} is {_show(saved)}, expected an int within 64 bits"]
        return []
    if type(live) is str:
        return [] if type(saved) is str else [f"{path} is {_show(saved)}, expected a str"]
    if type(live) in (tuple, list):
        if type(saved) is not type(live) or len(saved) != len(live):
            what = f"a {type(live).__name__} of {len(live)}"
            return [f"{path} is {_show(saved)}, expected {what} (as the target holds)"]
        out: list[str] = []
        for i, (a, b) in enumerate(zip(live, saved, strict=True)):
            out += value_problems(a, b, f"{path}[{i}]", depth=depth + 1)
        return out
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return [f"{path} is {_show(saved)}, expected a dict (as the target holds)"]
        out = []
        for key, value in live.items():
            if key in saved:
                out += value_problems(value, saved[key], f"{path}[{key!r}]", depth=depth + 1)
        return out
    return []


def scheduler_problems(live: Mapping[str, Any], saved: Any) -> list[str]:
    """Every value of a scheduler's saved state against the type the live one holds."""
    if not isinstance(saved, Mapping):
        return [f"the step's state_dict is {_show(saved)}, not a dict"]
    odd = [k for k in saved if type(k) is not str]
    if odd:  # a scheduler's state is its attributes: str names only
        return [f"the step's state_dict has keys that are not attribute names: {odd[:5]!r:.100}"]
    out: list[str] = []
    for key, value in live.items():
        if key in saved:
            out += value_problems(value, saved[key], repr(key))
    return out


def _signature_problems(live_sig: list[list[Any]], saved_sig: Any) -> list[str]:
    if not isinstance(saved_sig, list) or len(saved_sig) != len(live_sig):
        count = len(saved_sig) if isinstance(saved_sig, list) else None
        return [
            f"the step's parameter signature lists {count} parameters, the target "
            f"{len(live_sig)}; the step is damaged or of another model"
        ]
    out = []
    for i, (mine, theirs) in enumerate(zip(live_sig, saved_sig, strict=True)):
        if _is_signature(theirs) and theirs == list(mine):
            continue
        shown = f"{theirs[1]}{theirs[0]}" if _is_signature(theirs) else _show(theirs)
        out.append(f"parameter {i} is {mine[1]}{mine[0]} in the target, {shown} in the step")
    return out


def _is_signature(entry: Any) -> bool:
    """``[shape, dtype]`` as ``param_signature`` writes it: a list of ints and a str."""
    return (
        type(entry) is list
        and len(entry) == 2
        and type(entry[0]) is list
        and all(type(d) is int for d in entry[0])
        and type(entry[1]) is str
    )


def _group_problems(i: int, live: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in live.items():
        if key == "params":
            continue
        where = f"param_groups[{i}][{key!r}]"
        if key not in saved:
            if value is not None and type(value) is not bool and not isinstance(value, str):
                out.append(f"{where} is missing (the target's is {_show(value)})")
            continue
        found = value_problems(value, saved[key], where)
        if value is None and not (
            saved[key] is None or type(saved[key]) in (bool, int, float, str)
        ):
            # An option not set (foreach, fused, line_search_fn): a flag, a number or a name.
            found.append(f"{where} is {_show(saved[key])}, expected None, a bool, number or str")
        out += found
        if found:
            continue
        got = saved[key]
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if key in _NON_NEGATIVE and _number(got) and not (0 <= got < math.inf):
            out.append(f"{where} is {got!r}, expected a finite number >= 0")
        if key in _UNIT_TUPLES and isinstance(got, tuple):
            for j, beta in enumerate(got):
                b = beta.item() if isinstance(beta, torch.Tensor) and beta.numel() == 1 else beta
                if _number(b) and not 0 <= b < 1:
                    out.append(f"{where}[{j}] is {b!r}, expected a number in [0, 1)")
    return out


def _step_problem(where: str, value: Any) -> str | None:
    number = value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return f"{where} is {_show(value)}, expected a step count (one number)"
        number = value.item()
    if not _number(number) or not 0 <= number < math.inf:
        return f"{where} is {_show(value)}, expected a finite step count >= 0"
    return None


def _param_state_problems(
    where: str, param: torch.Tensor, live: Any, saved: Any, required: frozenset[str]
) -> list[str]:
    if not isinstance(saved, Mapping):
        return [f"{where} is {_show(saved)}, expected a dict of the parameter's state"]
    out: list[str] = []
    lacking = sorted(required - set(saved)) if saved else []
    if lacking:
        out.append(f"{where} lacks {', '.join(map(repr, lacking))}")
    if isinstance(live, Mapping) and live:
        missing = [k for k in live if k not in saved]
        extra = [k for k in saved if k not in live]
        if missing or extra:
            out.append(
                f"{where} holds {sorted(map(str, saved))}, the target's state for this "
                f"parameter {sorted(map(str, live))}"
            )
    for key, value in saved.items():
        at = f"{where}[{key!r}]"
        if key == "step":
            problem = _step_problem(at, value)
            if problem:
                out.append(problem)
            continue
        if key in required and not isinstance(value, torch.Tensor):
            # torch (>= 2.3) keeps every entry its step needs as a tensor; an optional one
            # may be None (SGD's momentum_buffer, which its step starts)
            out.append(
                f"{at} is {_show(value)}, expected a tensor: the optimizer's next step reads it"
            )
            continue
        mine = live.get(key) if isinstance(live, Mapping) else None
        if isinstance(mine, torch.Tensor) or (key in _PARAM_SHAPED and value is not None):
            if not isinstance(value, torch.Tensor):
                out.append(f"{at} is {_show(value)}, expected a tensor")
                continue
            shape = mine.shape if isinstance(mine, torch.Tensor) else param.shape
            if key in _PARAM_SHAPED and value.shape != param.shape:
                out.append(
                    f"{at} is {_show(value)}, its parameter {_show(param)}: a moment has its "
                    "parameter's shape"
                )
            elif value.shape != shape:
                out.append(f"{at} is {_show(value)}, the target holds {_show(mine)}")
            elif (value.is_floating_point() or value.is_complex()) != (
                param.is_floating_point() or param.is_complex()
            ) and key in _PARAM_SHAPED:
                out.append(f"{at} is {_show(value)}, expected the parameter's kind of dtype")
        elif type(mine) in (bool, int, float, str):
            # Scalars only: a list in the state (L-BFGS's history) may change length.
            out += value_problems(mine, value, at)
    return out


def optimizer_problems(
    optimizer: torch.optim.Optimizer, state: Any, live_sig: list[list[Any]], saved_sig: Any
) -> list[str]:
    """Everything in an optimizer's saved state the live optimizer could not step with."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    per_param = state.get("state") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or not isinstance(per_param, Mapping):
        return ["the step's state_dict has no param_groups/state"]
    if not all(isinstance(g, Mapping) for g in groups):
        return ["the step's param_groups are not all dicts"]
    odd = [k for g in groups for k in g if type(k) is not str]
    odd += [
        k for v in per_param.values() if isinstance(v, Mapping) for k in v if type(k) is not str
    ]
    if odd:  # option names, state names
        return [f"the step's param_groups or state have keys that are not names: {odd[:5]!r:.100}"]
    ids = [g.get("params") for g in groups]
    if not all(isinstance(p, list) and all(type(i) is int for i in p) for p in ids):
        return ["the step's param_groups' params are not lists of parameter ids"]
    live_sizes = [len(g["params"]) for g in optimizer.param_groups]
    saved_sizes = [len(p) for p in ids]
    if live_sizes != saved_sizes:
        return [f"parameters per group: {live_sizes} in the target, {saved_sizes} in the step"]
    flat = [i for p in ids for i in p]
    if len(set(flat)) != len(flat):
        return ["the step's param_groups name a parameter id twice"]
    out = _signature_problems(live_sig, saved_sig)
    for i, (mine, theirs) in enumerate(zip(optimizer.param_groups, groups, strict=True)):
        out += _group_problems(i, mine, theirs)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_id = dict(zip(flat, params, strict=True))
    unknown = [k for k in per_param if k not in by_id]
    if unknown:
        out.append(f"state holds entries for parameter ids no group lists: {unknown[:10]!r:.200}")
    group_of = {i: g for g, p in zip(groups, ids, strict=True) for i in p}
    for key, saved in per_param.items():
        param = by_id.get(key)
        if param is not None:
            live = optimizer.state.get(param)
            required = _required(optimizer, group_of[key])
            out += _param_state_problems(f"state[{key!r}]", param, live, saved, required)
    return out
