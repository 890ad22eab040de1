"""The writer lease of a root in object storage: generations of conditionally created objects.

An object store has no ``flock``. The lease is a sequence of objects
``<root>/.tdckpt-lease/<generation>.json`` (generation zero-padded), each created with a
conditional create (it fails if the object exists). The holder is the writer of the
highest generation, while that record is unexpired.

* acquire: list the generations; if the highest is another writer's and unexpired,
  refuse (:class:`~tdckpt.errors.LockError` naming its host, pid and expiry); else create
  the next generation. Of writers racing for it exactly one create succeeds; the others
  list again and are refused.
* renew (at every save, before the commit, and at every prune / gc): the highest
  generation must still be ours, else LockError ("lease lost"); if less than half the
  time to live is left, create the next generation with a new expiry.
* release (close): delete our record; the previous generations were already deleted. A
  process that ends without closing its manager releases its leases as it exits (as the
  operating system drops a local root's ``flock``); one that is killed leaves its lease to
  expire, and a writer refused by it is told when its holder, on the same host, is gone.

What it guarantees: two managers that both follow the protocol never hold the lease at
the same time, provided every writer renews more often than the time to live (default
600 s; every save renews) and the writers' clocks agree to well within it (expiry is
judged by the reader's clock against the time the holder wrote). A crashed holder's
lease is taken over once it expires.

What it does not: it is no fence. A holder that stalls past its expiry (a frozen VM, a
long GC pause) while another process takes over can still send writes it had begun; the
conditional create of each step's commit record is the only hard guarantee, and it holds
without the lease: two writers can never both commit one step. A clock that runs far
ahead on a new writer can take over a live lease. Deleting the lease objects by hand
breaks the guarantee.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
import weakref
from typing import Any

from tdckpt._remote.layout import LEASE_DIR
from tdckpt._remote.store import MAX_CONTROL_BYTES, Store, shorten
from tdckpt.errors import LockError, MetadataError

__all__ = ["DEFAULT_TTL_S", "Lease"]

DEFAULT_TTL_S = 600.0
#: A generation's name is zero-padded to this many digits; larger ones are simply wider
#: (generations are compared as numbers, never as names).
_DIGITS = 12
#: Widest generation read or written; a name past it is not a tdckpt lease and is ignored.
_MAX_DIGITS = 40
_MAX_GENERATION = 10**_MAX_DIGITS - 1


class Lease:
    def __init__(self, store: Store, owner: str, *, ttl: float = DEFAULT_TTL_S) -> None:
        if not ttl > 0:
            raise ValueError(f"lease_ttl must be a positive number of seconds, got {ttl!r}")
        self.store = store
        self.owner = owner
        self.ttl = float(ttl)
        self.generation: int | None = None
        self.expires = 0.0

    def _name(self, gen: int) -> str:
        return f"{LEASE_DIR}/{gen:0{_DIGITS}d}.json"

    def _generations(self) -> list[int]:
        """The generations listed, as numbers, in order. Only tdckpt's own names count
        (``<digits>.json``, zero-padded to 12 digits, wider only when the number is):
        anything else in the folder - a stray file, a sub-folder, a non-canonical or
        absurdly long number - is ignored, never parsed into a crash."""
        gens = []
        for entry in self.store.ls(LEASE_DIR):
            if entry.get("type") == "directory":
                continue
            base = self.store.rel(str(entry.get("name", ""))).rsplit("/", 1)[-1]
            stem = base.removesuffix(".json")
            if (
                base.endswith(".json")
                and _DIGITS <= len(stem) <= _MAX_DIGITS
                and stem.isascii()
                and stem.isdigit()
                and base == self._name(int(stem)).rsplit("/", 1)[-1]
            ):
                gens.append(int(stem))
        return sorted(gens)

    def _read(self, gen: int) -> dict[str, Any] | None:
        """The record of ``gen``; None if it is gone; ``{}`` (treated as expired) if it is
        not a lease record tdckpt wrote: not JSON, not an object, or larger than
        :data:`~tdckpt._remote.store.MAX_CONTROL_BYTES` (then not read past the cap)."""
        try:
            raw = json.loads(
                self.store.cat_capped(self._name(gen), MAX_CONTROL_BYTES, "lease record")
            )
        except FileNotFoundError:
            return None
        except (MetadataError, ValueError, RecursionError):  # UnicodeDecodeError too
            return {}  # a damaged record: treated as expired
        return raw if isinstance(raw, dict) else {}

    def _next(self, gen: int) -> int:
        if gen >= _MAX_GENERATION:
            raise LockError(
                f"{self.store.show(LEASE_DIR)}: the lease generation has reached the largest "
                f"this tdckpt writes ({_MAX_DIGITS} digits); the lease objects were not written "
                "by tdckpt. Stop every writer of this root, delete the objects under "
                f"{self.store.show(LEASE_DIR)}, and retry.",
                root=self.store.url,
                path=self.store.show(LEASE_DIR),
            )
        return gen + 1

    def _create(self, gen: int) -> bool:
        now = time.time()
        record: dict[str, Any] = {
            "owner": self.owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "written": now,
            "expires": now + self.ttl,
        }
        try:
            self.store.create(self._name(gen), json.dumps(record).encode())
        except FileExistsError:
            return False
        self.generation = gen
        self.expires = record["expires"]
        _HELD.add(self)
        return True

    def acquire(self) -> None:
        for _ in range(20):
            gens = self._generations()
            top = gens[-1] if gens else 0
            if gens:
                current = self._read(top)
                if current is None:
                    continue  # released meanwhile: list again
                expires = _expiry(current.get("expires"))
                now = time.time()
                if current.get("owner") != self.owner and expires is not None and expires > now:
                    holder = {k: _field(current.get(k)) for k in ("host", "pid", "owner")}
                    gone = (
                        f" Its process is no longer running on this host: it was killed "
                        f"before it could release the lease, which expires in "
                        f"{expires - now:.0f} s."
                        if _gone(current)
                        else ""
                    )
                    raise LockError(
                        f"{self.store.show(LEASE_DIR)}: another writer holds this root's lease "
                        f"(host {holder['host']}, pid {holder['pid']}, manager "
                        f"{holder['owner']}, expires in {expires - now:.0f} s).{gone} Only one "
                        "process saves to a root at a time: close the other manager, or wait "
                        "for its lease to expire if it crashed.",
                        root=self.store.url,
                        path=self.store.show(self._name(top)),
                        holder=_holder(current, expires),
                    )
            if self._create(self._next(top)):
                self._cleanup(gens)
                return
        raise LockError(  # pragma: no cover - 20 lost races in a row
            f"{self.store.url}: could not take the lease (other writers keep taking it).",
            root=self.store.url,
            path=self.store.show(LEASE_DIR),
        )

    def _cleanup(self, gens: list[int]) -> None:
        with contextlib.suppress(Exception):
            self.store.rm_files(self._name(g) for g in gens)

    def renew(self) -> None:
        """Check the lease is still ours (LockError if not) and extend it when half used."""
        if self.generation is None:
            self.acquire()
            return
        # One listing: we created our generation with a conditional create, so while it is
        # the highest it is ours (nobody else can have written that name).
        gens = self._generations()
        if not gens or gens[-1] != self.generation:
            gen, self.generation = self.generation, None
            raise LockError(
                f"{self.store.show(LEASE_DIR)}: this manager's lease (generation {gen}) was "
                "lost - it expired and another writer took the root, or it was deleted. "
                "Nothing was committed by this call; stop this writer, or close and reopen "
                "the manager once the other writer is done.",
                root=self.store.url,
                path=self.store.show(LEASE_DIR),
            )
        if self.expires - time.time() < self.ttl / 2:
            old = self.generation
            if not self._create(self._next(old)):
                self.generation = None
                raise LockError(
                    f"{self.store.show(LEASE_DIR)}: another writer took the lease while it was "
                    "being renewed; nothing was committed by this call.",
                    root=self.store.url,
                    path=self.store.show(LEASE_DIR),
                )
            self._cleanup([old])

    def release(self) -> None:
        _HELD.discard(self)
        if self.generation is None:
            return
        gen, self.generation = self.generation, None
        with contextlib.suppress(Exception):
            if (self._read(gen) or {}).get("owner") == self.owner:
                self.store.rm_files([self._name(gen)])


#: The leases this process holds: released at exit (:func:`_release_at_exit`).
_HELD: weakref.WeakSet[Lease] = weakref.WeakSet()


def _release_at_exit() -> None:
    """Release every lease a manager that was never closed still holds (best effort: the
    store may be unreachable by then). ``atexit`` hooks run after the interpreter has
    joined its threads, so a save still in flight at exit has finished (or failed) first."""
    for lease in list(_HELD):
        with contextlib.suppress(Exception):
            lease.release()


atexit.register(_release_at_exit)


def _gone(record: dict[str, Any]) -> bool:
    """Whether the lease ``record`` names a process of this host that no longer runs."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or type(pid) is not int or pid <= 0:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, OSError):
        return False
    return False


def _expiry(value: Any) -> float | None:
    """A record's expiry as seconds, or None if it holds none a writer could have written
    (not a number, a bool, NaN, or an integer too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return None if seconds != seconds else seconds


def _field(value: Any) -> str:
    """A field of a lease record for a message: short whatever the record holds."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return shorten(str(value) if value.bit_length() < 128 else "a huge integer", 60)
    return repr(shorten(value if isinstance(value, str) else type(value).__name__, 60))


def _holder(record: dict[str, Any], expires: float) -> dict[str, Any]:
    """The LockError's ``holder`` fact: the record's fields, each short or None."""
    pid = record.get("pid")
    return {
        "host": shorten(record["host"], 60) if isinstance(record.get("host"), str) else None,
        "pid": pid if type(pid) is int and pid.bit_length() < 64 else None,
        "owner": shorten(record["owner"], 60) if isinstance(record.get("owner"), str) else None,
        "expires": expires,
    }
