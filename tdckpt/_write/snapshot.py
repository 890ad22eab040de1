"""Stage a planned checkpoint into reusable CPU buffers: a snapshot later writes cannot reach.

:meth:`tdckpt.CheckpointManager.save_async` must return as soon as the values it will save
are safe from the training loop, then write them on a background thread. What makes them
safe is done here, on the caller's thread:

* the object is checked and planned (:func:`tdckpt._write.save.prepare_checkpoint`): every
  ``meta.json``, every pickle of non-tensor data and every JSON field is serialized to
  ``bytes`` right then, so non-tensor data is frozen at the call;
* every leaf tensor the plan writes - plain CPU, shared-memory, memory-mapped
  (``MemoryMappedTensor``), a view, a conj/neg view, a nested tensor, a leaf of a lazy stack
  or tensorclass, or a tensor on an accelerator - is copied into one reusable CPU buffer
  (:class:`StagingBuffers`), as the C-order bytes the writer streams to its file.

The plan then refers to the buffer only: nothing the caller does to its object afterwards -
in-place writes, ``share_memory_()`` aliases, writes through another mapping of the same
memmap file - can reach the checkpoint. The buffer is reused by the next snapshot of the
same layout (the manager keeps one save in flight, so at most one staged copy of the state
exists), and freed before a different layout is allocated, so memory stays flat over any
number of saves. Sources on an accelerator are copied into pinned (page-locked) memory with
``non_blocking=True``, and the copy waits for those devices before returning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from tdckpt._write.save import PreparedCheckpoint
from tdckpt._write.save_plan import Op, Plan
from tdckpt._write.writer import pieces
from tdckpt.errors import UnsupportedContentError

__all__ = ["StagingBuffers"]

#: Each leaf's bytes start at a multiple of this (any dtype can view its slice).
_ALIGN = 64

#: Test hook: when set, the thread that writes a snapshot calls it with each leaf file's
#: relative path before writing that file (tests slow the write down, or kill the process,
#: at a chosen leaf). Never set by tdckpt itself.
_between_leaves: Callable[[str], None] | None = None


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _leaf_nbytes(t: torch.Tensor) -> int:
    """The number of bytes the writer streams for ``t`` (its C-order bytes)."""
    if t.is_nested:
        return sum(_leaf_nbytes(c) for c in t.unbind())
    return t.numel() * t.element_size()


class _StagedOps(list[Op]):
    """The staged plan's operations; iterating calls the :data:`_between_leaves` test hook."""

    def __iter__(self) -> Iterator[Op]:
        for op in super().__iter__():
            hook = _between_leaves
            if hook is not None and op.kind == "tensor":
                hook(op.rel)
            yield op


class StagingBuffers:
    """One reusable CPU buffer holding the leaves of the latest snapshot.

    :meth:`stage` copies every leaf of a prepared checkpoint into the buffer and returns
    the same plan reading from it. A next snapshot with the same layout (the same leaf
    sizes, in the same order, and the same need for pinned memory) reuses the buffer; any
    other layout frees it first, then allocates a new one. Only one snapshot may use the
    buffer at a time: the caller must not stage again before the previous snapshot has
    been written (the manager waits for the save in flight first).
    """

    def __init__(self) -> None:
        self._layout: tuple[tuple[int, ...], bool] | None = None
        self._arena: torch.Tensor | None = None
        #: How many times a buffer was allocated (tests check reuse with it).
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """The size of the buffer held now (0 when none)."""
        return 0 if self._arena is None else int(self._arena.numel())

    def release(self) -> None:
        """Free the buffer (the next :meth:`stage` allocates a new one)."""
        self._arena = None
        self._layout = None

    def _buffer(self, sizes: tuple[int, ...], pinned: bool) -> torch.Tensor:
        layout = (sizes, pinned)
        if self._arena is None or self._layout != layout:
            self.release()  # free the old buffer before allocating: never two at once
            total = sum(_round_up(n) for n in sizes)
            self._arena = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pinned)
            self._layout = layout
            self.allocations += 1
        return self._arena

    def stage(self, prepared: PreparedCheckpoint) -> PreparedCheckpoint:
        """Copy every leaf of ``prepared`` into the buffer; return the plan reading from it.

        Returns when every copy is complete (accelerator copies included), so the caller's
        tensors may change right after.
        """
        ops = prepared.plan.ops
        leaves = [op.tensor for op in ops if op.kind == "tensor" and op.tensor is not None]
        sizes = tuple(_leaf_nbytes(t) for t in leaves)
        devices = {t.device for t in leaves if t.device.type != "cpu"}
        pinned = bool(devices) and _can_pin()
        arena = self._buffer(sizes, pinned)
        staged = _StagedOps()
        offset = 0
        for op in ops:
            if op.kind != "tensor" or op.tensor is None:
                staged.append(op)
                continue
            n = _leaf_nbytes(op.tensor)
            dest = arena[offset : offset + n]
            _copy_leaf(op.tensor, dest)
            staged.append(replace(op, tensor=dest))
            offset += _round_up(n)
        for device in devices:
            _synchronize(device)
        plan = Plan(
            ops=staged,
            pickles=list(prepared.plan.pickles),
            problems=[],
            problem_keys=[],
        )
        return PreparedCheckpoint(plan=plan, root_type=prepared.root_type)


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)  # MemoryMappedTensor, Parameter, ...: no dispatch
    return t


def _copy_leaf(src: torch.Tensor, dest: torch.Tensor) -> None:
    """Copy ``src``'s C-order bytes into the uint8 buffer slice ``dest``."""
    if src.is_nested:
        offset = 0
        for piece in pieces(src):  # components back to back, as the writer streams them
            raw = piece.reshape(-1).view(torch.uint8)
            dest[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()
        return
    src = _plain(src)
    # A typed, shaped view of the slice: copy_ handles strides, conj/neg bits and devices.
    typed = dest.view(src.dtype).view(src.shape) if src.dim() else dest.view(src.dtype)[0]
    typed.copy_(src, non_blocking=src.device.type != "cpu")


def _can_pin() -> bool:
    try:
        return bool(torch.cuda.is_available()) or _accelerator_available()
    except Exception:  # a broken driver: fall back to pageable memory
        return False


def _accelerator_available() -> bool:
    accelerator: Any = getattr(torch, "accelerator", None)
    return accelerator is not None and bool(accelerator.is_available())


def _synchronize(device: torch.device) -> None:
    """Wait until the non-blocking copies from ``device`` have landed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    module: Any = getattr(torch, device.type, None)
    if module is not None and callable(getattr(module, "synchronize", None)):
        module.synchronize()
    else:
        torch.accelerator.synchronize(device)


def detached_copy(obj: Any) -> Any:
    """A copy of a tensor collection that shares nothing with ``obj``.

    Tensors are cloned into plain CPU memory (memory-mapped and shared-memory leaves
    included; accelerator tensors stay on their device) and non-tensor values are
    deep-copied (a pickle round trip of the clone, which holds no file-backed storage),
    so later in-place writes to ``obj`` - its tensors or its Python values - cannot reach
    the copy. Used by collective ``save_async``, whose shard protocol needs a TensorDict.
    """
    import pickle

    from tensordict import is_tensor_collection

    if not is_tensor_collection(obj):
        return obj  # the save protocol refuses it, on every rank, with the usual message
    try:
        return pickle.loads(pickle.dumps(obj.clone(), protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:  # a value's own copy or pickle code raised
        raise UnsupportedContentError(
            "save_async takes a copy of the state that later writes cannot reach, and "
            f"copying it failed ({type(exc).__name__}: {exc}); nothing was saved. Make its "
            "non-tensor values copyable (copy.deepcopy and pickle), or use save().",
        ) from exc
