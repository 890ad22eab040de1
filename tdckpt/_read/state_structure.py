"""The budgets of a training state's saved structure, shared by the writer and every reader.

A training-state step stores each entry's ``state_dict`` as a tagged JSON structure (see
:mod:`tdckpt._state.encode`). The encoder refuses a state_dict beyond these budgets; the
decoder, ``validate`` and the restore refuse a saved structure beyond the very same ones, so
whatever tdckpt writes it reads back, and nothing it reads can exhaust the stack (a structure
nested 900 deep) or the CPU (a 4000-digit integer) of the process reading it.

:func:`structure_problem` walks a structure without recursion and counts levels as the
encoder does: a list's items, a tuple's items and a dict's keys and values are one level
below their container, whatever the JSON tags around them.
"""

from __future__ import annotations

from typing import Any

from tdckpt._report import Problem

__all__ = [
    "MAX_STATE_DEPTH",
    "MAX_STATE_INT_BITS",
    "MAX_STATE_NODES",
    "STATE_STRUCTURE_KEY",
    "state_problems",
    "structure_problem",
]

#: The key, inside a training-state entry, of its JSON structure.
STATE_STRUCTURE_KEY = "__state__"
#: How deep a state_dict may nest (lists, tuples and dicts inside one another).
MAX_STATE_DEPTH = 100
#: The largest integer a state_dict may hold, in bits of magnitude (a 309-digit number; a
#: PCG64 generator's 128-bit state fits, a 4000-digit number does not).
MAX_STATE_INT_BITS = 1024
#: How many values (containers, numbers, strings, tensors) one entry's structure may hold.
MAX_STATE_NODES = 4_000_000

_DICT_TAGS = frozenset({"dict", "odict", "counter"})


def structure_problem(structure: Any) -> str | None:
    """What makes a saved structure exceed the budgets, or None when it is within them.

    ``structure`` is the JSON data of an entry's ``__state__`` (``{"state_dict": ...,
    ...}``); each of its values is a value at level 0, as the encoder wrote it.
    """
    if type(structure) is not dict:
        return None  # not a structure at all: the decoder says what is wrong with it
    stack: list[tuple[Any, int, str]] = [(v, 0, str(k)) for k, v in structure.items()]
    nodes = 0
    while stack:
        node, depth, path = stack.pop()
        nodes += 1
        if nodes > MAX_STATE_NODES:
            return f"holds more than {MAX_STATE_NODES} values"
        if depth > MAX_STATE_DEPTH:
            return f"nests more than {MAX_STATE_DEPTH} levels deep (at {path!r})"
        kind = type(node)
        if kind is int and node.bit_length() > MAX_STATE_INT_BITS:
            return (
                f"holds an integer of {node.bit_length()} bits at {path!r}, more than the "
                f"{MAX_STATE_INT_BITS} bits tdckpt writes"
            )
        if kind is list:
            stack.extend((v, depth + 1, f"{path}.{i}") for i, v in enumerate(node))
        elif kind is dict:
            if len(node) == 1:
                ((tag, body),) = node.items()
                if tag == "tuple" and type(body) is list:
                    stack.extend((v, depth + 1, f"{path}.{i}") for i, v in enumerate(body))
                    continue
                if tag in _DICT_TAGS and type(body) is list:
                    for pair in body:
                        if type(pair) is list and len(pair) == 2:
                            key = pair[0] if _short(pair[0]) else "?"
                            stack.append((pair[0], depth + 1, path))
                            stack.append((pair[1], depth + 1, f"{path}.{key}"))
                        else:
                            stack.append((pair, depth + 1, path))
                    continue
            # A leaf tag ({"tensor": name}, ...) or something tdckpt does not write: its
            # values are counted one level down all the same.
            stack.extend((v, depth + 1, f"{path}.{k}") for k, v in node.items())
    return None


def _short(key: Any) -> bool:
    return type(key) is str or (type(key) is int and key.bit_length() <= 64)


def state_problems(manifest: Any, root: Any) -> list[Problem]:
    """``validate``'s problems with a training-state step's saved structures.

    ``manifest`` is the validated manifest model (or None), ``root`` the checkpoint's root
    node. Every entry that is not a TensorDict holds its structure at ``<entry>/__state__``;
    one beyond the budgets is an error (``state-structure``), as the restore refuses it.
    """
    from tdckpt._read.nodes import NonTensorNode, TensorDictNode

    state = getattr(manifest, "state", None)
    if state is None or not isinstance(root, TensorDictNode):
        return []
    problems = []
    for name, entry in state.entries.items():
        holder = root.entries.get(name)
        if entry.kind == "tensordict" or not isinstance(holder, TensorDictNode):
            continue
        node = holder.entries.get(STATE_STRUCTURE_KEY)
        if not isinstance(node, NonTensorNode) or not node.has_data:
            continue
        beyond = structure_problem(node.data)
        if beyond is not None:
            problems.append(
                Problem(
                    "state-structure",
                    "error",
                    node.path,
                    node.key,
                    f"training-state entry {name!r}: the saved structure {beyond}; tdckpt "
                    "never writes that and a restore refuses it. The step is damaged or "
                    "hostile; restore it from a backup.",
                )
            )
    return problems
