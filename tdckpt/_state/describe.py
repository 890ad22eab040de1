"""Lines that describe a training-state step, for ``tdckpt inspect``."""

from __future__ import annotations

from typing import Any

__all__ = ["describe_state"]


def _totals(info: Any) -> tuple[int, int]:
    if info.kind == "leaf":
        return 1, int(info.nbytes or 0)
    count = size = 0
    for child in info.children:
        c, s = _totals(child)
        count, size = count + c, size + s
    return count, size


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def describe_state(state: dict[str, Any], root: Any) -> list[str]:
    """One line per entry: name, kind, class, tensor count and bytes (from the metadata)."""
    entries = state.get("entries") or {}
    children = {child.key[-1]: child for child in root.children if child.key}
    rows = []
    for name, entry in entries.items():
        info = children.get(name)
        count, size = _totals(info) if info is not None else (0, 0)
        rows.append(
            (
                name,
                entry.get("kind", "?"),
                str(entry.get("type", "?")).replace(":", "."),
                count,
                size,
            )
        )
    width = max((len(r[0]) for r in rows), default=0)
    kind_width = max((len(r[1]) for r in rows), default=0)
    lines = [f"training state {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}"]
    for name, kind, cls, count, size in rows:
        lines.append(
            f"  {name.ljust(width)}  {kind.ljust(kind_width)}  {cls}  "
            f"({count} tensor{'s' if count != 1 else ''}, {_size(size)})"
        )
    return lines
