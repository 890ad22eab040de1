"""Saved tensorclass names: what ``<class 'module.Name'>`` resolves to in this process.

A tensorclass level records its class as ``_type == "<class 'module.Name'>"``. Like
tensordict, tdckpt never imports a module a checkpoint names (that would run code chosen by
whoever wrote the file): the class must be imported already. Validation and the restore
engine both resolve the name here, so that what validation accepts the build can construct:

* the module is not imported: nothing can be said yet (the restore asks to import it);
* the name resolves to a tensorclass: fine (its declared fields are then checked too);
* the name resolves to anything else - no such attribute, a function, a TensorDict, a
  NonTensorData, a plain class - : the checkpoint cannot be restored in this process.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["ResolvedClass", "declared_fields", "resolve_class"]


@dataclass(frozen=True)
class ResolvedClass:
    """The outcome of resolving a saved class name.

    Attributes:
        name: ``module.Qualname`` as saved.
        module: the module part.
        cls: the tensorclass, when the name resolves to one.
        problem: why the name cannot be used (None when ``cls`` is set or the module is
            not imported).
    """

    name: str
    module: str
    cls: type | None
    problem: str | None


def _is_tensorclass(obj: Any) -> bool:
    if not isinstance(obj, type):
        return False
    td = sys.modules.get("tensordict")
    if td is None:  # no tensordict loaded: nothing can be a tensorclass
        return False
    from tensordict import is_tensorclass
    from tensordict.tensorclass import NonTensorDataBase

    return bool(is_tensorclass(obj)) and not issubclass(obj, NonTensorDataBase)


def resolve_class(type_str: str) -> ResolvedClass:
    """Resolve ``"<class 'module.Name'>"`` among the modules already imported."""
    name = type_str.removeprefix("<class '").removesuffix("'>")
    module_name, _, qualname = name.rpartition(".")
    if (
        not type_str.startswith("<class '")
        or not type_str.endswith("'>")
        or not module_name
        or not qualname
    ):
        return ResolvedClass(
            name,
            module_name,
            None,
            f"{type_str!r:.80} is not a class name of the form \"<class 'module.Name'>\"",
        )
    td_base = sys.modules.get("tensordict.base")
    for cls in getattr(td_base, "_ACCEPTED_CLASSES", ()):
        # Every tensorclass registers itself here, also one defined inside a function.
        if str(cls) == type_str and _is_tensorclass(cls):
            return ResolvedClass(name, module_name, cls, None)
    # The longest imported module prefix (a nested class's module is shorter than rpartition's).
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            module_name, qualname = ".".join(parts[:cut]), ".".join(parts[cut:])
            break
    else:
        return ResolvedClass(name, module_name, None, None)
    if "<locals>" in qualname:
        return ResolvedClass(
            name,
            module_name,
            None,
            f"{name} is a class defined inside a function; it cannot be found by name",
        )
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return ResolvedClass(
                name,
                module_name,
                None,
                f"the imported module {module_name} has no class {qualname}",
            )
    if not _is_tensorclass(obj):
        what = (
            type(obj).__name__
            if not isinstance(obj, type)
            else f"the class {obj.__module__}.{obj.__qualname__}"
        )
        return ResolvedClass(name, module_name, None, f"{name} is {what}, not a tensorclass")
    return ResolvedClass(name, module_name, obj, None)


def declared_fields(cls: type) -> set[str]:
    """The fields a tensorclass declares (a tensorclass is a dataclass)."""
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}
