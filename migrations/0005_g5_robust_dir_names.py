"""G5 -> G6: percent-encoded directory names, and tensorclass identity for TensorClass subclasses.

What changed in tensordict 0.14.0:

* child collection directories are percent-encoded too (PR #1762): ``sub dir/`` became
  ``sub%20dir/``, ``"."`` became ``%2E/`` and ``""`` became ``%/``; the legacy fallback is
  limited to "safe" keys. Every earlier writer - 0.13 included, whatever ``robust_key``
  said - named directories with the raw key (a key ``"a/b"`` as the chain ``a/b/``);
* instances of classes declared with the ``TensorClass`` *subclass* syntax keep their
  class (PR #1722). From 0.10.0 to 0.13.x they were saved as a plain TensorDict directory
  while the parent listed ``{"type": "Foo"}``, so they reloaded as TensorDicts;
* ``.tdz`` archives (PR #1735), pickle opt-in (PRs #1763/#1764), tagged sub-tensordict
  indexes (PR #1736): nothing to migrate, tensordict 0.15.3 still reads the old forms.

What this step does, per G5 directory:

* ``dir_encoding = "legacy"`` (unless an earlier step set it): the names stage then looks
  child directories up by their raw names;
* an entry ``{"type": "Foo"}`` whose directory is a plain TensorDict (the 0.10-0.13 bug)
  is re-wrapped as the tensorclass it was - ``{"_type": "<class 'mod.Foo'>"}`` with the
  TensorDict as its ``_tensordict/`` - when the tree names the module of ``Foo`` exactly
  once (another, correctly saved instance of the same class). Otherwise the class
  identity is recorded as lost and the entry restores as a TensorDict.
"""

from __future__ import annotations

from tdckpt._read.migrate import (
    CLASS_IDS,
    LAZY_STACK_NAMES,
    NON_TENSOR_NAMES,
    TD_LIKE_NAMES,
    MigrationContext,
    Target,
    VDir,
    encode_key,
    entries_of,
    level_kind,
    parse_type,
)

FROM_VERSION = 5
TO_VERSION = 6

_KNOWN = TD_LIKE_NAMES | NON_TENSOR_NAMES | LAZY_STACK_NAMES | frozenset(CLASS_IDS)


def upgrade(tree: VDir, ctx: MigrationContext) -> VDir:
    modules: dict[str, set[str]] | None = None
    for target in ctx.targets(tree):
        node = target.node
        if node.meta is None:
            continue
        node.dir_encoding = node.dir_encoding or "legacy"
        if level_kind(node.meta) != "tensordict":
            continue
        _leaves, children = entries_of(node.meta)
        for key in children:
            wanted = node.meta[key].get("type")
            if not isinstance(wanted, str) or wanted in _KNOWN:
                continue
            name, child = _child_dir(node, key)
            if child is None or level_kind(child.meta) != "tensordict":
                continue
            if modules is None:
                modules = _tensorclass_modules(tree)
            found = modules.get(wanted, set())
            if len(found) == 1:
                (module,) = found
                node.dirs[name] = VDir(
                    source=child.source,
                    meta={"_type": f"<class '{module}.{wanted}'>"},
                    dirs={"_tensordict": child},
                )
                ctx.problem(
                    "rewrapped-tensorclass",
                    "info",
                    target,
                    f"saved as a plain TensorDict by the TensorClass-subclass bug of "
                    f"tensordict 0.10-0.13; restored as {module}.{wanted}, the class the "
                    "parent names (its module found on another entry of the checkpoint).",
                    key=key,
                )
            else:
                ctx.lose(
                    Target(child, node, key),
                    f"an instance of the tensorclass {wanted!r} that tensordict 0.10-0.13 "
                    "saved as a plain TensorDict (TensorClass-subclass bug, fixed in 0.14 by "
                    "#1722): the class's module was not saved, so it restores as a TensorDict "
                    "with the same fields.",
                )
    return tree


def _child_dir(node: VDir, key: str) -> tuple[str, VDir | None]:
    for name in (key, encode_key(key)):
        if "/" not in name and name not in ("", ".", "..") and name in node.dirs:
            return name, node.dirs[name]
    return key, None


def _tensorclass_modules(tree: VDir) -> dict[str, set[str]]:
    """Class name -> the modules that correctly saved tensorclasses of that name name."""
    out: dict[str, set[str]] = {}
    for node in tree.walk():
        if level_kind(node.meta) != "tensorclass":
            continue
        assert node.meta is not None
        parsed = parse_type(node.meta.get("_type"))
        if parsed is not None and parsed[0]:
            out.setdefault(parsed[1], set()).add(parsed[0])
    return out
