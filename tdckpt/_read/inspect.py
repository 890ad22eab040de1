"""``validate`` and ``inspect``: what a checkpoint is and whether it is sound.

Both run the read path up to validation (``_pipeline.open_checkpoint``) and never read
a leaf byte or write anything.
"""

from __future__ import annotations

import os
from typing import Any

from tdckpt._read.nodes import (
    LazyStackNode,
    LazyViewNode,
    LeafNode,
    Node,
    NonTensorNode,
    NonTensorStackNode,
    SubTensorDictNode,
    TensorClassNode,
    TensorDictNode,
    pickled_nodes,
)
from tdckpt._read.object_open import open_source
from tdckpt._read.pipeline import open_checkpoint
from tdckpt._read.state_structure import state_problems
from tdckpt._remote.urls import is_url
from tdckpt._report import Inspection, NodeInfo, Problem, ValidationReport
from tdckpt.errors import TdckptError
from tdckpt.schema import FORMAT_VERSION

__all__ = ["inspect", "validate"]


def validate(
    prefix: str | os.PathLike[str],
    *,
    robust_key: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ValidationReport:
    """Check a checkpoint and report every problem at once.

    Missing or short leaf files, unknown dtypes, impossible shapes, leaves that do not
    start with their batch size, listed children that do not exist, stray files, two
    keys sharing one file, pickled values, malformed metadata: all are collected. Nothing
    is written and no leaf byte is read.

    Args:
        prefix: a checkpoint directory or ``.tdz`` archive.
        robust_key: the key encoding (None: decide per directory from what is on disk).
        storage_options: for an fsspec URL prefix (``s3://...``), the filesystem's options.

    Returns:
        A :class:`ValidationReport`; ``report.ok`` is False when any problem is an error.

    Example:
        >>> import tdckpt, tempfile, torch
        >>> from tensordict import TensorDict
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = TensorDict(a=torch.ones(3)).memmap(d)
        ...     tdckpt.validate(d).ok
        True
    """
    try:
        opened = open_checkpoint(open_source(prefix, storage_options), robust_key=robust_key)
    except TdckptError as exc:
        if is_url(prefix):
            return ValidationReport(
                prefix=str(prefix), problems=[Problem(_code(exc), "error", "", (), str(exc))]
            )
        return ValidationReport(
            prefix=os.fspath(prefix),
            problems=[Problem(_code(exc), "error", _rel_path(exc, prefix), (), str(exc))],
        )
    try:
        problems = list(opened.problems)
        problems += state_problems(opened.manifest_model, opened.root)
        if opened.root is not None:
            for node in pickled_nodes(opened.root):
                problems.append(
                    Problem(
                        "pickle",
                        "info",
                        node.pickle.source or node.path,  # type: ignore[union-attr]
                        node.key,
                        "a non-tensor value stored as a pickle: it loads only with "
                        "allow_pickle=True (pickle can run code). `tdckpt upgrade "
                        "--convert-pickles` stores plain values as JSON.",
                    )
                )
        return opened.validation_report(problems)
    finally:
        opened.close()


def _rel_path(exc: TdckptError, prefix: str | os.PathLike[str]) -> str:
    """The error's file relative to the prefix (``""`` when it names the prefix itself)."""
    path = getattr(exc, "path", None)
    if not isinstance(path, str) or path in ("", "."):
        return ""
    base = os.fspath(prefix).rstrip(os.sep)
    if path == base:
        return ""
    if path.startswith(base + os.sep):
        return path[len(base) + 1 :].replace(os.sep, "/")
    return "" if os.path.isabs(path) else path


def _code(exc: TdckptError) -> str:
    name = type(exc).__name__
    return {
        "UnsupportedFormatError": "unsupported-format",
        "CheckpointNotFoundError": "not-found",
        "UnsafePathError": "unsafe-path",
    }.get(name, "unreadable")


def inspect(
    prefix: str | os.PathLike[str],
    *,
    robust_key: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Inspection:
    """Describe a checkpoint from its metadata alone.

    Reports the format generation that wrote it, the key encoding, the migrations an
    in-memory read applies, the pickled values, and the tree of keys with dtypes, shapes
    and sizes. No leaf byte is read.

    Raises:
        tdckpt.errors.TdckptError: the prefix is not a readable checkpoint.

    ``prefix`` may be an fsspec URL (with ``storage_options``): only its metadata objects
    are fetched.
    """
    opened = open_checkpoint(open_source(prefix, storage_options), robust_key=robust_key)
    try:
        root = (
            _info(opened.root, ())
            if opened.root is not None
            else NodeInfo(key=(), kind="unreadable", path="")
        )
        total, leaves = _totals(root)
        pickles = [n.key for n in pickled_nodes(opened.root)] if opened.root is not None else []
        return Inspection(
            prefix=opened.prefix,
            storage=opened.storage.kind,
            generation=opened.generation,
            format_version=FORMAT_VERSION if opened.generation == "G8" else 0,
            key_encoding=opened.key_encoding,
            root=root,
            total_bytes=total,
            leaf_count=leaves,
            pickles=pickles,
            migrations=opened.migrations,
            lost=opened.lost,
            manifest=opened.manifest,
            problems=opened.problems,
        )
    finally:
        opened.close()


def _totals(info: NodeInfo) -> tuple[int, int]:
    total = info.nbytes if info.kind == "leaf" else 0
    count = 1 if info.kind == "leaf" else 0
    for child in info.children:
        t, c = _totals(child)
        total += t
        count += c
    return total, count


def _info(node: Node, key: tuple[str, ...]) -> NodeInfo:
    if isinstance(node, LeafNode):
        return NodeInfo(
            key=node.key,
            kind="leaf",
            path=node.path,
            dtype=str(node.dtype),
            shape=list(node.shape),
            nbytes=node.nbytes,
            class_name="nested" if node.is_nested else None,
        )
    if isinstance(node, TensorDictNode):
        return NodeInfo(
            key=node.key,
            kind="tensordict",
            path=node.path,
            class_name=node.class_id,
            batch_size=list(node.batch_size),
            children=[_info(v, (*key, k)) for k, v in node.entries.items()],
        )
    if isinstance(node, LazyStackNode):
        return NodeInfo(
            key=node.key,
            kind="lazy-stack",
            path=node.path,
            class_name=node.class_id,
            children=[_info(m, (*key, str(i))) for i, m in enumerate(node.members)],
        )
    if isinstance(node, TensorClassNode):
        inner = _info(node.inner, key)
        return NodeInfo(
            key=node.key,
            kind="tensorclass",
            path=node.path,
            class_name=node.type_str.removeprefix("<class '").removesuffix("'>"),
            batch_size=inner.batch_size,
            pickled=node.pickle is not None,
            children=inner.children,
        )
    if isinstance(node, (SubTensorDictNode, LazyViewNode)):
        # The one child is the source the view reads (the _source directory).
        return NodeInfo(
            key=node.key,
            kind="sub-tensordict" if isinstance(node, SubTensorDictNode) else "lazy-view",
            path=node.path,
            class_name=node.class_id,
            batch_size=list(node.batch_size),
            children=[_info(node.source, key)],
        )
    if isinstance(node, NonTensorNode):
        return NodeInfo(
            key=node.key,
            kind="non-tensor",
            path=node.path,
            class_name=node.class_name,
            batch_size=list(node.batch_size),
            pickled=node.pickle is not None,
        )
    assert isinstance(node, NonTensorStackNode)
    return NodeInfo(
        key=node.key,
        kind="non-tensor-stack",
        path=node.path,
        class_name="NonTensorStack",
        pickled=node.pickle is not None,
    )
