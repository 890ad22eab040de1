"""A tiny mutation check for tdckpt's validation and apply stages (no mutmut needed).

Each mutant replaces one exact, unique piece of source text (a negated condition, an
off-by-one, a deleted check) in validation, the apply and commit stages, the lane or storage,
runs a selection of tests with ``-x``, and records whether the suite noticed (killed) and by
which test. It works on a private copy of the package and tests (``--work``, default a
temporary folder), so the worktree is never modified and other test runs are not disturbed.

    python tools/mutate.py                     # every mutant, the default test selection
    python tools/mutate.py V13 A05             # only these
    python tools/mutate.py --tests tests/test_validate.py -- V13

Prints a Markdown table: mutant | file:line | change | killed by.
"""

# ruff: noqa: E501 - each mutant quotes one line of tdckpt source verbatim, however long it is.
from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VALIDATE = "tdckpt/_read/validate.py"
VALIDATE_LEAF = "tdckpt/_read/validate_leaf.py"
VALIDATE_CHECKS = "tdckpt/_read/validate_checks.py"
VALIDATE_VALUES = "tdckpt/_read/validate_values.py"
APPLY = "tdckpt/_restore/apply.py"
COMMIT = "tdckpt/_restore/commit.py"
KINDS = "tdckpt/_restore/kinds.py"
BUILD = "tdckpt/_restore/build.py"
LANE = "tdckpt/_read/lane.py"
STORAGE = "tdckpt/_read/directory.py"

#: (id, file, original text, mutated text, what the mutant does)
MUTANTS: list[tuple[str, str, str, str, str]] = [
    ("V01", VALIDATE, "ctx.problems.extend(vdir.problems)", "pass", "read problems dropped"),
    (
        "V02",
        VALIDATE,
        "if not any(p.path.startswith(vdir.source) and "
        'p.severity == "error" for p in vdir.problems):',
        "if True:",
        "missing-meta also beside a read error",
    ),
    (
        "V03",
        VALIDATE,
        "if not any(p.path.startswith(vdir.source) and "
        'p.severity == "error" for p in vdir.problems):',
        "if False:",
        "missing-meta never reported",
    ),
    ("V04", VALIDATE, "if own and key:", "if False:", "read problem not re-keyed"),
    (
        "V05",
        VALIDATE,
        'if cls_name not in _TD_CLASSES or module.split(".")[0] != "tensordict":',
        "if cls_name not in _TD_CLASSES:",
        "_class module not checked",
    ),
    (
        "V06",
        VALIDATE,
        'if cls_name not in _TD_CLASSES or module.split(".")[0] != "tensordict":',
        'if module.split(".")[0] != "tensordict":',
        "_class name not checked",
    ),
    (
        "V07",
        VALIDATE,
        "    if not check_device(ctx, vdir, key, model.device):\n"
        "        return None\n    batch = model.shape",
        "    batch = model.shape",
        "TD level device check deleted",
    ),
    (
        "V08",
        VALIDATE_CHECKS,
        "if device is None or _is_torch_device(device):",
        "if True:",
        "every device accepted",
    ),
    (
        "V09",
        VALIDATE,
        "if model.names is not None and len(model.names) != len(batch):",
        "if False:",
        "_names length check deleted",
    ),
    (
        "V10",
        VALIDATE,
        "len(model.names) != len(batch)",
        "len(model.names) > len(batch)",
        "_names: too few accepted",
    ),
    (
        "V11",
        VALIDATE,
        "        _check_batch_prefix(built, batch, ctx)\n",
        "",
        "nested batch-prefix check deleted",
    ),
    (
        "V12",
        VALIDATE_LEAF,
        "if numel * max(dtype.itemsize, 1) > MAX_BYTES:",
        "if numel * max(dtype.itemsize, 1) >= MAX_BYTES:",
        "overflow bound off by one",
    ),
    (
        "V13",
        VALIDATE_LEAF,
        "if numel * max(dtype.itemsize, 1) > MAX_BYTES:",
        "if False:",
        "overflow check deleted",
    ),
    (
        "V14",
        VALIDATE_LEAF,
        "if len(shape) != 2:",
        "if len(shape) < 2:",
        "size-table rank: 3-d accepted",
    ),
    (
        "V15",
        VALIDATE_LEAF,
        "if leaf.shape_file.size < numel * 8:",
        "if leaf.shape_file.size < numel * 8 - 1:",
        "size table one byte short accepted",
    ),
    (
        "V16",
        VALIDATE_LEAF,
        "if leaf.shape_file.size < numel * 8:",
        "if leaf.shape_file.size <= numel * 8:",
        "exact-size size table refused",
    ),
    (
        "V17",
        VALIDATE_LEAF,
        "if sizes is None or (sizes < 0).any():",
        "if sizes is None:",
        "negative sizes accepted",
    ),
    (
        "V18",
        VALIDATE_LEAF,
        "if any(d > MAX_BYTES for row in rows for d in row) or (",
        "if False or (",
        "huge nested dim accepted",
    ),
    (
        "V19",
        VALIDATE_LEAF,
        "            leaf.numel * max(dtype.itemsize, 1) > MAX_BYTES\n",
        "            False\n",
        "huge nested total accepted",
    ),
    (
        "V20",
        VALIDATE_LEAF,
        "if batch and shape[0] != batch[0]:",
        "if False:",
        "nested batch check deleted",
    ),
    (
        "V21",
        VALIDATE_LEAF,
        "if shape[: len(batch)] != batch:",
        "if False:",
        "dense batch check deleted",
    ),
    (
        "V22",
        VALIDATE_LEAF,
        "        if need:\n",
        "        if True:\n",
        "zero-byte leaf needs a file",
    ),
    (
        "V23",
        VALIDATE_LEAF,
        "    elif 0 <= vfile.size < need:",
        "    elif 0 <= vfile.size < need - 1:",
        "leaf one byte short accepted",
    ),
    (
        "V24",
        VALIDATE_LEAF,
        "    elif 0 <= vfile.size < need:",
        "    elif 0 <= vfile.size <= need:",
        "exact-size leaf refused",
    ),
    (
        "V25",
        VALIDATE_LEAF,
        "    if need == 0 and not is_nested:\n",
        "    if False:\n",
        "zero-element leaf claims its file",
    ),
    (
        "V26",
        VALIDATE_LEAF,
        "        if other != key:",
        "        if False:",
        "name-collision check deleted",
    ),
    (
        "V27",
        VALIDATE,
        "    if child_batch is not None and tuple(child_batch[: len(batch)]) != batch:",
        "    if False:",
        "batch-prefix check disabled",
    ),
    (
        "V28",
        VALIDATE,
        "    elif isinstance(node, TensorClassNode):\n        child_batch = node.inner.batch_size",
        "    elif False:\n        child_batch = node.inner.batch_size",
        "tensorclass batch not prefix-checked",
    ),
    (
        "V29",
        VALIDATE,
        "    elif isinstance(node, (SubTensorDictNode, LazyViewNode)):\n"
        "        child_batch = node.batch_size",
        "    elif False:\n        child_batch = node.batch_size",
        "view batch not prefix-checked",
    ),
    ("V30", VALIDATE, "if len(batches) > 1:", "if len(batches) > 2:", "stack batch check weakened"),
    (
        "V31",
        VALIDATE,
        "if len(devices) > 1:",
        "if len(devices) > 2:",
        "stack device check weakened",
    ),
    (
        "V32",
        VALIDATE,
        "if model.stack_dim > len(b):",
        "if model.stack_dim >= len(b):",
        "stack_dim at the end refused",
    ),
    (
        "V33",
        VALIDATE,
        "if model.stack_dim > len(b):",
        "if model.stack_dim > len(b) + 1:",
        "stack_dim one past accepted",
    ),
    (
        "V34",
        VALIDATE_VALUES,
        'saved.get("pickle_sha256") != digest',
        "False",
        "json_types sha256 not compared",
    ),
    (
        "V35",
        VALIDATE_VALUES,
        "not isinstance(types, dict) or not all(",
        "not isinstance(types, dict) or False and all(",
        "json_types names not checked",
    ),
    (
        "V36",
        VALIDATE_VALUES,
        'cls = "MetaData" if "MetaData" in model.type_ else "NonTensorData"',
        'cls = "NonTensorData"',
        "MetaData restored as NonTensorData",
    ),
    (
        "V37",
        VALIDATE_VALUES,
        "if not node.has_data and node.pickle is None and node.json_types is None:",
        "if False:",
        "non-tensor without value accepted",
    ),
    (
        "V38",
        VALIDATE_VALUES,
        "if _list_depth(model.data, 64) > 64:",
        "if _list_depth(model.data, 64) > 65:",
        "list depth bound off by one",
    ),
    (
        "V39",
        VALIDATE_VALUES,
        "while isinstance(cur, list) and depth <= limit:",
        "while isinstance(cur, list) and depth < limit:",
        "list depth never exceeds the limit",
    ),
    (
        "V40",
        VALIDATE_VALUES,
        "if parent_batch and len(model.data) != parent_batch[0]:",
        "if False:",
        "non-tensor stack batch check deleted",
    ),
    (
        "V41",
        VALIDATE_VALUES,
        "        if node.pickle is None:\n",
        "        if False:\n",
        "missing pickle.pkl accepted",
    ),
    (
        "V42",
        VALIDATE_VALUES,
        "    if not check_device(ctx, vdir, key, model.device):\n"
        "        return None\n    node = NonTensorStackNode",
        "    node = NonTensorStackNode",
        "non-tensor stack device check deleted",
    ),
    (
        "V43",
        VALIDATE,
        "        if inner is not None:\n",
        "        if False:\n",
        "tensorclass inner kind not reported",
    ),
    (
        "V44",
        VALIDATE_CHECKS,
        'meant = "ChildEntry" if "type" in entry and "dtype" not in entry else "LeafEntry"',
        'meant = "LeafEntry"',
        "every entry read as a leaf",
    ),
    (
        "V45",
        VALIDATE_CHECKS,
        "                    continue\n            sub = (*key, loc[1])",
        "                    pass\n            sub = (*key, loc[1])",
        "both union branches reported",
    ),
    (
        "V46",
        VALIDATE_CHECKS,
        "            sub = (*key, loc[1])\n",
        "            sub = key\n",
        "schema problem not keyed by entry",
    ),
    (
        "A01",
        APPLY,
        "if not is_tensorclass(target) or is_non_tensor_data(target):",
        "if not is_tensorclass(target):",
        "NonTensorData taken for a tensorclass target",
    ),
    (
        "A02",
        APPLY,
        "if not is_tensorclass(target) or is_non_tensor_data(target):",
        "if False:",
        "tensorclass kind check deleted",
    ),
    (
        "A03",
        APPLY,
        "if str(type(target)) != node.type_str:",
        "if False:",
        "tensorclass class check deleted",
    ),
    (
        "A04",
        APPLY,
        "            check_tensorclass_fields(type(target), fields, node.inner.entries, "
        "self.where(node))\n",
        "",
        "tensorclass field check deleted",
    ),
    (
        "A05",
        APPLY,
        "            if not is_lazy_stack(target):\n",
        "            if False:\n",
        "lazy-stack kind check deleted",
    ),
    (
        "A06",
        APPLY,
        "if len(members) != len(node.members):",
        "if False:",
        "member count check deleted",
    ),
    (
        "A07",
        APPLY,
        "if target.stack_dim != node.stack_dim:",
        "if False:",
        "stack_dim check deleted",
    ),
    (
        "A08",
        APPLY,
        "if not is_td(target) or is_lazy_stack(target):",
        "if not is_td(target):",
        "lazy stack target for a TensorDict",
    ),
    (
        "A09",
        APPLY,
        "if isinstance(sub, TensorDictNode) and isinstance(existing, dict):",
        "if False:",
        "nested dicts not reused",
    ),
    (
        "A10",
        APPLY,
        "if target.is_locked and not target.is_memmap():",
        "if target.is_locked:",
        "locked memmap target refused",
    ),
    (
        "A11",
        APPLY,
        "if target.is_locked and not target.is_memmap():",
        "if False:",
        "locked target accepted",
    ),
    (
        "A12",
        APPLY,
        "shape = sub.shape[:1] if sub.is_nested else sub.shape\n                if shape[:nb] != batch:",
        "shape = sub.shape\n                if shape[:nb] != batch:",
        "nested leaf checked by its size table",
    ),
    (
        "A13",
        APPLY,
        "                if shape[:nb] != batch:\n",
        "                if False:\n",
        "leaf batch check deleted",
    ),
    (
        "A14",
        APPLY,
        "and is_td(existing)\n                    and not is_lazy_stack(existing)",
        "and is_td(existing)",
        "lazy stack reused for a TensorDict",
    ),
    (
        "A16",
        APPLY,
        "and is_tensorclass(existing)\n                    and str(type(existing)) == sub.type_str",
        "and is_tensorclass(existing)",
        "other tensorclass reused",
    ),
    (
        "A17",
        APPLY,
        " and len(existing.tensordicts) == len(sub.members)",
        "",
        "stack of another length reused",
    ),
    (
        "A19",
        APPLY,
        "and is_non_tensor_data(existing)\n                and type(existing).__name__ == sub.class_name\n",
        "and is_non_tensor_data(existing)\n",
        "MetaData/NonTensorData mixed up",
    ),
    (
        "A20",
        APPLY,
        "elif (\n                isinstance(sub, NonTensorNode)\n",
        "elif (\n                False\n                and isinstance(sub, NonTensorNode)\n",
        "NonTensorData never reused",
    ),
    (
        "A21",
        APPLY,
        "                    self.plan.non_tensors.extend(_built_non_tensors(value, sub))\n",
        "                    pass\n",
        "new nested NonTensorData not memmap-flagged",
    ),
    (
        "A22",
        APPLY,
        "if vb is not None and vb[:nb] != batch:",
        "if False:",
        "entry batch check deleted",
    ),
    (
        "A23",
        APPLY,
        "            if isinstance(sub, NonTensorNode):\n                self.plan.non_tensors",
        "            if False:\n                self.plan.non_tensors",
        "NonTensorData not memmap-flagged",
    ),
    (
        "A24",
        APPLY,
        "        self.claim(target, node)\n        types",
        "        types",
        "alias check in into() deleted",
    ),
    (
        "A25",
        APPLY,
        "                self.claim(existing, sub)\n",
        "",
        "alias check of NonTensorData deleted",
    ),
    (
        "A26",
        APPLY,
        "        if not claimed:\n",
        "        if False:\n",
        "alias check of nested dicts deleted",
    ),
    (
        "A27",
        APPLY,
        "        if len(claimed) == count:",
        "        if False:",
        "alias check disabled",
    ),
    (
        "A28",
        COMMIT,
        "if is_td(inner) and inner.device is not None:",
        "if False:",
        "target device ignored",
    ),
    (
        "A29",
        COMMIT,
        "if was_locked and root_td is not None and not root_td.is_locked:",
        "if False:",
        "no relock on rollback",
    ),
    (
        "A30",
        COMMIT,
        "            if mapper.records_prefix:",
        "            if True:",
        "memmap kept after an 'r' restore",
    ),
    (
        "A31",
        COMMIT,
        "                    lvl._is_memmap = True\n",
        "                    lvl._is_memmap = False\n",
        "memmap flag not set",
    ),
    (
        "A32",
        COMMIT,
        "                root_td.lock_()\n            else:",
        "                pass\n            else:",
        "memmap target not relocked",
    ),
    (
        "A33",
        COMMIT,
        "    levels += _non_tensor_levels(levels)\n",
        "",
        "NonTensorData flags not snapshotted",
    ),
    (
        "A34",
        COMMIT,
        "_all_td_levels(holder) if was_memmap else",
        "[lvl for lvl, _ in plan.prefixes] if was_memmap else",
        "only planned levels snapshotted",
    ),
    (
        "A35",
        COMMIT,
        "        if is_lazy_stack(cur):\n",
        "        if False:\n",
        "lazy-stack members not walked",
    ),
    (
        "A36",
        COMMIT,
        "        if is_tensorclass(cur) and not is_non_tensor_data(cur):\n",
        "        if False:\n",
        "tensorclass levels not walked",
    ),
    (
        "A37",
        APPLY,
        "    if isinstance(node, TensorClassNode) and is_tensorclass(value):",
        "    if False:",
        "NonTensorData in new tensorclass missed",
    ),
    (
        "A38",
        APPLY,
        "    if isinstance(node, LazyStackNode) and is_lazy_stack(value):",
        "    if False:",
        "NonTensorData in new stack missed",
    ),
    (
        "A39",
        COMMIT,
        'ntd._tensordict._memmap_prefix = path / "_tensordict" if path is not None else None',
        "ntd._tensordict._memmap_prefix = None",
        "NonTensorData prefix not set",
    ),
    (
        "A40",
        KINDS,
        "type(obj) is types[4] or isinstance(obj, types[0])",
        "type(obj) is types[4]",
        "TensorDict subclasses not TensorDicts",
    ),
    (
        "A41",
        COMMIT,
        "            store.clear()\n            store.update(new)",
        "            store.update(new)",
        "stale keys kept",
    ),
    (
        "A42",
        COMMIT,
        "        for store, items in snapshot_items:\n            store.clear()",
        "        for store, items in []:\n            store.clear()",
        "items not rolled back",
    ),
    (
        "A43",
        COMMIT,
        "        for obj, fields in snapshot_fields:\n",
        "        for obj, fields in []:\n",
        "fields not rolled back",
    ),
    (
        "A44",
        COMMIT,
        "        for lvl, prefix, memmapped in snapshot_flags:\n",
        "        for lvl, prefix, memmapped in []:\n",
        "flags not rolled back",
    ),
    (
        "L02",
        LANE,
        "if level is None or not _already_robust(node, meta):",
        "if level is None:",
        "lane assumes robust names",
    ),
    (
        "L03",
        LANE,
        "if level is None or not _already_robust(node, meta):",
        "if not _already_robust(node, meta):",
        "lane reads levels not in exact form",
    ),
    (
        "L04",
        LANE,
        '        if problems or root is None:\n            raise TdckptError("validation problems")',
        '        if root is None:\n            raise TdckptError("validation problems")',
        "lane restores despite validation problems",
    ),
    (
        "L05",
        LANE,
        "    if levels is None:\n        return False",
        "    if levels is None:\n        return True",
        "lane reads trees not marked current",
    ),
    (
        "A45",
        BUILD,
        "    for key in current:\n        if key in tensors:",
        "    for key in ():\n        if key in tensors:",
        "in place, keys lose the target's order",
    ),
    (
        "A46",
        BUILD,
        "    for key, value in tensors.items():\n        ordered.setdefault(key, value)\n",
        "",
        "new saved tensors after the new sub-levels",
    ),
    (
        "T01",
        "tdckpt/_read/tree.py",
        '        if not rel and listing.dirs:\n            root = storage.dir_identity("")',
        '        if False:\n            root = storage.dir_identity("")',
        "a link back to the prefix read as a new directory",
    ),
    (
        "S01",
        STORAGE,
        "st.st_size >= need\n                        and is_reg(st.st_mode)",
        "is_reg(st.st_mode)",
        "deferred leaf size never checked",
    ),
    (
        "E01",
        "tdckpt/_restore/reading.py",
        "if self.from_lane or (opened is not None and _short_leaf(opened)):",
        "if False:",
        "no full read after a failed shortcut",
    ),
    # -- the trust checks of the new surfaces (issue 22) -----------------------------------
    (
        "G01",
        "tdckpt/_state/rng.py",
        "if not _is_int(pos) or not 0 <= pos <= MT_WORDS:",
        "if not _is_int(pos):",
        "NumPy pos range unchecked (out-of-bounds reads)",
    ),
    (
        "G02",
        "tdckpt/_state/check.py",
        "if key in _PARAM_SHAPED and value.shape != param.shape:",
        "if False:",
        "optimizer state shape not checked against its parameter",
    ),
    (
        "H01",
        "tdckpt/_shard/check.py",
        "if rows != shard.stop - shard.start:",
        "if False:",
        "a shard's real rows not checked against the manifest",
    ),
    (
        "H02",
        "tdckpt/_shard/manifest.py",
        "if found != recorded:",
        "if False:",
        "sharded manifest checksum not checked",
    ),
    (
        "M01",
        "tdckpt/_read/expected.py",
        "if found == digest:",
        "if True:",
        "metadata read on restore not compared with the manifest",
    ),
    (
        "R01",
        "tdckpt/_store/objects.py",
        "            if step in damaged:\n                # A record this tdckpt cannot read",
        "            if False:\n                # A record this tdckpt cannot read",
        "gc collects attempts of a step whose record it cannot read",
    ),
]

_VALIDATE_TESTS = [
    "tests/test_validate_checks.py",
    "tests/test_validate.py",
    "tests/test_views.py",
    "tests/test_hostile.py",
    "tests/test_hostile_metadata.py",
]
_RESTORE_TESTS = [
    "tests/test_apply_checks.py",
    "tests/test_restore_aliases.py",
    "tests/test_restore_failures.py",
    "tests/test_restore.py",
    "tests/test_restore_tensorclass.py",
    "tests/test_views.py",
    "tests/test_hardening_fuzz.py",
]
DEFAULT_TESTS = {
    VALIDATE: _VALIDATE_TESTS,
    VALIDATE_LEAF: _VALIDATE_TESTS,
    VALIDATE_CHECKS: _VALIDATE_TESTS,
    VALIDATE_VALUES: _VALIDATE_TESTS,
    APPLY: _RESTORE_TESTS,
    COMMIT: _RESTORE_TESTS,
    KINDS: _RESTORE_TESTS,
    BUILD: _RESTORE_TESTS,
    LANE: ["tests/test_lane.py", "tests/test_restore_failures.py"],
    STORAGE: ["tests/test_storage.py", "tests/test_hardening_storage.py"],
    "tdckpt/_read/tree.py": ["tests/test_hardening_dos.py", "tests/test_hostile.py"],
    "tdckpt/_restore/reading.py": [
        "tests/test_lane.py",
        "tests/test_hardening_storage.py",
        "tests/test_restore_failures.py",
    ],
    "tdckpt/_state/rng.py": ["tests/test_state_trust.py"],
    "tdckpt/_state/check.py": ["tests/test_state_trust.py"],
    "tdckpt/_shard/check.py": ["tests/test_sharded_checks.py"],
    "tdckpt/_shard/manifest.py": ["tests/test_sharded_checks.py"],
    "tdckpt/_read/expected.py": ["tests/test_metadata_checked.py"],
    "tdckpt/_store/objects.py": ["tests/test_remote_trust.py"],
}


def copy_tree(work: Path) -> Path:
    """The package, tests and what they read, copied under ``work``."""
    dst = work / "tree"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for name in ("tdckpt", "tests", "migrations", "schemas"):
        shutil.copytree(
            ROOT / name, dst / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    for name in ("pyproject.toml", "README.md", "CHANGELOG.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dst / name)
    return dst


def run_one(
    tree: Path, mid: str, file: str, old: str, new: str, tests: list[str]
) -> tuple[int, str]:
    path = tree / file
    original = path.read_text(encoding="utf-8")
    count = original.count(old) if old else 1
    if count != 1:
        raise SystemExit(f"{mid}: the original text occurs {count} times in {file}")
    line = original[: original.index(old)].count("\n") + 1
    if old:
        mutated = original.replace(old, new, 1)
        try:
            ast.parse(mutated)
        except SyntaxError as exc:
            raise SystemExit(
                f"{mid}: the mutant is not valid Python ({exc}); fix its text"
            ) from exc
        path.write_text(mutated, encoding="utf-8")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *tests],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        path.write_text(original, encoding="utf-8")
    if proc.returncode == 0:
        return line, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
    if not failed and mid == "base":
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    return line, failed[0] if failed else f"rc={proc.returncode}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("ids", nargs="*", help="mutant ids (default: all)")
    parser.add_argument("--tests", nargs="+", help="test files to run instead of the defaults")
    parser.add_argument(
        "--work", type=Path, help="where to put the copy (default: a temporary folder)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tdckpt-mutate-") as tmp:
        tree = copy_tree(args.work or Path(tmp))
        return run_all(tree, args)


def run_all(tree: Path, args: argparse.Namespace) -> int:
    chosen = [m for m in MUTANTS if not args.ids or m[0] in args.ids]
    for file in sorted({m[1] for m in chosen}):
        check = subprocess.run(
            [sys.executable, "-c", "import tdckpt; print(tdckpt.__file__)"],
            cwd=tree,
            capture_output=True,
            text=True,
        )
        if not check.stdout.startswith(str(tree)):
            raise SystemExit(
                f"the copy does not import its own tdckpt: {check.stdout or check.stderr}"
            )
        # The unmutated copy must pass, or every mutant would look killed.
        baseline = run_one(tree, "base", file, "", "", args.tests or DEFAULT_TESTS[file])[1]
        if baseline:
            raise SystemExit(f"the unmutated tests fail ({baseline}); fix that first")
    print("| mutant | file:line | change | killed by |")
    print("|---|---|---|---|")
    survivors = 0
    for mid, file, old, new, what in chosen:
        line, killer = run_one(tree, mid, file, old, new, args.tests or DEFAULT_TESTS[file])
        survivors += not killer
        print(f"| {mid} | {file}:{line} | {what} | {killer or '**SURVIVED**'} |", flush=True)
    print(f"\n{len(chosen) - survivors}/{len(chosen)} killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
