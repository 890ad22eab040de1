"""The background half of :meth:`tdckpt.CheckpointManager.save_async`.

One thread per manager (a one-worker executor, started on the first asynchronous save)
writes the staged snapshot, checksums it, fsyncs it, commits it and applies retention - the
same locked body :meth:`~tdckpt.CheckpointManager.save` runs. :class:`BackgroundSaver`
keeps at most one save in flight and makes sure its error is never lost:

* :meth:`SaveFuture.result` / :meth:`SaveFuture.exception` hand it to whoever asks;
* otherwise the next save (either kind) raises :class:`~tdckpt.errors.AsyncSaveError` for
  it before starting, and so does :meth:`~tdckpt.CheckpointManager.close` (and leaving
  the ``with`` block), which first waits for the save in flight.

Warnings raised by tdckpt while the background thread works (retention that could not
remove an old step, for instance) are not issued on that thread: they are kept with the
save and issued on the caller's thread, with the caller's line as their location, when the
save's outcome is delivered (``result()``, ``exception()``, the next save or ``close()``).

In a process group, collectives the background save runs must not share the user's group
with the training loop (the main thread's collectives would race them, and both hang).
:attr:`BackgroundSaver.context` is the hook for that: a callable returning a context
manager the background thread enters around every save, e.g. one that directs the shard
protocol to a gloo group tdckpt made for it with ``dist.new_group(backend="gloo")``.

A save in flight when the interpreter exits (a script that ends right after ``save_async``,
without ``close()``) is finished first: :func:`_finish_at_exit` runs before Python joins
its threads and shuts its thread pools down, waits for every manager's save in flight, and
prints to stderr the step of any that failed, so a step is never lost silently.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # its exit hook is registered before ours (_finish_at_exit)
import contextlib
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from tdckpt.errors import AsyncSaveError

__all__ = ["BackgroundSaver", "SaveFuture", "warn"]

_local = threading.local()

#: Every BackgroundSaver of this process, for :func:`_finish_at_exit`.
_savers: weakref.WeakSet[BackgroundSaver] = weakref.WeakSet()


def warn(message: str, category: type[Warning], *, stacklevel: int) -> None:
    """``warnings.warn``, except on a background save's thread: kept for the caller then."""
    kept: list[tuple[str, type[Warning]]] | None = getattr(_local, "warnings", None)
    if kept is not None:
        kept.append((message, category))
        return
    warnings.warn(message, category, stacklevel=stacklevel + 1)


class SaveFuture:
    """The outcome of one :meth:`~tdckpt.CheckpointManager.save_async` (Future-like).

    When it is returned, the snapshot is staged: the state may change freely. The step is
    listed (:meth:`~tdckpt.CheckpointManager.steps`, ``latest_step()``) only once
    :meth:`done` and the save succeeded - after its files, manifest and folder are durable.

    Attributes:
        step: the step being saved.
    """

    def __init__(self, step: int, future: concurrent.futures.Future[Path | str]) -> None:
        self.step = step
        self._future = future
        self._retrieved = False
        self._warnings: list[tuple[str, type[Warning]]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        if not self._future.done():
            state = "running"
        elif self._future.exception() is not None:
            state = f"failed: {type(self._future.exception()).__name__}"
        else:
            state = f"committed: {self._future.result()}"
        return f"<SaveFuture step={self.step} {state}>"

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._future.done()

    def running(self) -> bool:
        """True while the background thread writes the step."""
        return self._future.running()

    def result(self, timeout: float | None = None) -> Path | str:
        """Wait for the save; return the committed folder (or archive), or raise its error.

        Raises:
            TimeoutError: still running after ``timeout`` seconds (nothing is delivered;
                ask again later).
            Exception: whatever made the background save fail (the step is not listed).
        """
        try:
            path = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise
        except BaseException:
            self._deliver(stacklevel=2)
            raise
        self._deliver(stacklevel=2)
        return path

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save; return its error (None when it committed).

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
        """
        error = self._future.exception(timeout)
        self._deliver(stacklevel=2)
        return error

    # -- delivery --------------------------------------------------------------------------
    def _deliver(self, *, stacklevel: int) -> None:
        """The outcome was handed over: issue the kept warnings on this thread.

        ``stacklevel`` 1 is the caller of ``_deliver``, 2 its caller, and so on.
        """
        with self._lock:
            self._retrieved = True
            kept, self._warnings = self._warnings, []
        for message, category in kept:
            warnings.warn(message, category, stacklevel=stacklevel + 1)

    def _undelivered_error(self) -> BaseException | None:
        """The error nobody has retrieved (marking it delivered), or None."""
        if not self._future.done() or self._future.cancelled():
            return None
        error = self._future.exception()
        with self._lock:
            if error is None or self._retrieved:
                return None
            self._retrieved = True
        return error


class BackgroundSaver:
    """At most one background save in flight, on one thread; errors always delivered.

    Attributes:
        context: None, or a callable returning a context manager the background thread
            enters around each save (the hook for a tdckpt-owned process group).
    """

    def __init__(self, root: Path | str) -> None:
        self.root = root
        self.context: Callable[[], AbstractContextManager[Any]] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: SaveFuture | None = None
        self._guard = threading.Lock()
        self._pid = os.getpid()
        _savers.add(self)

    def _forked(self) -> None:
        # A forked child has none of its parent's threads: the parent's save in flight is
        # the parent's to finish and report; the child starts its own thread when needed.
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._executor = None
            self._inflight = None

    def submit(self, step: int, job: Callable[[], Path | str]) -> SaveFuture:
        """Run ``job`` on the background thread (call :meth:`drain` first)."""
        self._forked()
        holder: list[SaveFuture] = []

        def run() -> Path | str:
            kept: list[tuple[str, type[Warning]]] = []
            _local.warnings = kept
            try:
                context = self.context() if self.context is not None else contextlib.nullcontext()
                with context:
                    return job()
            finally:
                _local.warnings = None
                holder[0]._warnings.extend(kept)

        with self._guard:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="tdckpt-save"
                )
            # The future object exists before the job can run: `holder` is filled first.
            inner: concurrent.futures.Future[Path | str] = concurrent.futures.Future()
            future = SaveFuture(step, inner)
            holder.append(future)

            def chained() -> None:
                if not inner.set_running_or_notify_cancel():
                    return
                try:
                    result = run()
                except BaseException as exc:
                    inner.set_exception(exc)
                else:
                    inner.set_result(result)

            self._executor.submit(chained)
            self._inflight = future
        return future

    def wait(self) -> SaveFuture | None:
        """Wait until the save in flight (if any) has committed or failed."""
        self._forked()
        future = self._inflight
        if future is not None:
            concurrent.futures.wait([future._future])
        return future

    def drain(self, *, before: str, stacklevel: int) -> SaveFuture | None:
        """Wait for the save in flight; raise its error if nobody retrieved it. Returns the
        latest save submitted (finished now), if any.

        ``before`` says what now does not happen (for the message); the kept warnings are
        issued at ``stacklevel`` (1: the caller of ``drain``, 2: its caller...).
        """
        future = self.wait()
        if future is None:
            return None
        error = future._undelivered_error()
        future._deliver(stacklevel=stacklevel + 1)
        if error is not None:
            raise AsyncSaveError(
                f"{self.root}: the background save of step {future.step} failed "
                f"({type(error).__name__}: {error}); step {future.step} was not committed, and "
                f"the steps committed before it are intact. Raised now, before {before}, "
                "because nobody called result() on its SaveFuture. Fix the cause and save again.",
                path=str(self.root),
                step=future.step,
            ) from error
        return future

    def shutdown(self, *, stacklevel: int) -> AsyncSaveError | None:
        """Wait for the save in flight, stop the thread; return its undelivered error."""
        self.wait()
        with self._guard:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        try:
            self.drain(before="close() released the root", stacklevel=stacklevel + 1)
        except AsyncSaveError as failure:
            return failure
        return None

    def finish_at_exit(self) -> None:
        """Wait for the save in flight; print its failure (the step) to stderr, if any.

        Called by :func:`_finish_at_exit` while the interpreter shuts down, when nobody is
        left to raise an error to.
        """
        if self._pid != os.getpid():
            return  # a forked child: the parent's save is the parent's to finish
        future = self.wait()
        if future is None:
            return
        error = future._undelivered_error()
        with future._lock:
            kept, future._warnings = future._warnings, []
        for message, category in kept:
            print(f"tdckpt: {category.__name__}: {message}", file=sys.stderr, flush=True)
        if error is not None:
            print(
                f"tdckpt: {self.root}: the background save of step {future.step} failed "
                f"while the interpreter was exiting ({type(error).__name__}: {error}); step "
                f"{future.step} was NOT committed (the steps committed before it are intact). "
                "Call result() on the SaveFuture, wait() or close() before the script ends "
                "to get this error as an exception.",
                file=sys.stderr,
                flush=True,
            )


def _finish_at_exit() -> None:
    """Finish every save in flight before the interpreter exits (a step is never lost).

    ``threading`` runs the hooks of ``threading._register_atexit`` in reverse order of
    registration, before it joins the non-daemon threads. concurrent.futures registered its
    own hook - which makes every thread pool refuse new work, and a save's writer submits
    to pools - when this module imported it, so this one runs first: the save in flight
    still has its pools. (``atexit`` hooks run only after the threads are joined: too late.)
    """
    for saver in list(_savers):
        try:
            saver.finish_at_exit()
        except Exception as exc:  # shutting down: report it, and go on with the other savers
            print(
                f"tdckpt: {saver.root}: could not finish a save at exit: {exc!r}",
                file=sys.stderr,
            )


_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_finish_at_exit)
else:  # pragma: no cover - every CPython tdckpt supports has it (3.9+)
    import atexit

    atexit.register(_finish_at_exit)
