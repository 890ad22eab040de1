"""The leaf entries of a consolidated file's levels, checked.

Each level of a consolidated file's metadata lists its leaves as
``key: [dtype, shape, start, stop, pad]`` (a sixth field, the ragged index, for nested jagged
tensors). :class:`LeafEntries` checks them level by level - every dtype known, every shape
plain ints, every byte range inside the leaf region, sized exactly for its shape and dtype
plus at most 7 bytes of padding, aligned for its dtype - and, once every level is in,
that no two leaves share a byte. The usual level, every entry as tensordict writes it, is
checked column by column (the loops run in C: a 10,000-leaf file is the large one); any
other is checked entry by entry, which says exactly what is wrong.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from typing import Any, NoReturn, cast

import torch

from tdckpt._read.nodes import DTYPES
from tdckpt.errors import MetadataError, UnsupportedFormatError

__all__ = ["MAX_NDIM", "LeafEntries"]

#: Dimensions of a leaf's shape, at most (as a meta.json's).
MAX_NDIM = 64

_ITEMSIZE = operator.attrgetter("itemsize")
#: The largest product of a shape's dims (zeros counted as 1) torch's strides can hold.
_MAX_STRIDE_SPAN = 2**63 - 1


def _stride_span(shape: Any) -> int:
    """The product of ``shape``'s dims with each zero counted as 1, as torch computes the
    strides (a zero-element leaf with huge other dims cannot be built)."""
    return math.prod(max(d, 1) for d in shape)


#: ``fail(key, what, cls)``: the error to raise for ``what`` at ``key`` (see the parser).
Fail = Callable[..., MetadataError]


class LeafEntries:
    """The leaf entries of every level of one file, checked as they come.

    ``data_size``: the bytes of the leaf region (every leaf lies inside it); ``fail``: makes
    the error for a key (it names the file). :meth:`check` takes one level's entries;
    :meth:`check_overlaps`, once every level is in, refuses leaves whose bytes overlap.
    """

    def __init__(self, data_size: int, fail: Fail) -> None:
        self.data_size = data_size
        self.fail = fail
        #: starts and ends of the leaves with bytes, in file order, for the overlap check;
        #: ``labels`` says whose they are (level key, its leaf names with bytes), in order
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.labels: list[tuple[tuple[str, ...], list[str]]] = []

    def check(
        self, key: tuple[str, ...], leaves: dict[str, Any]
    ) -> tuple[list[torch.dtype], list[int], list[int], list[tuple[int, ...]]]:
        """Check every leaf entry of one level: (dtypes, bytes without padding, starts,
        shapes), in order.

        The usual level - every entry ``[dtype, shape, start, stop, pad]`` with plain ints,
        as tensordict writes them - is checked column by column (the loops run in C: a
        10,000-leaf checkpoint is the large one); a level with anything else is checked
        entry by entry by :meth:`_leaf`, which accepts it or says what is wrong.
        """
        specs = list(leaves.values())
        if not specs:
            return [], [], [], []
        columns = self._columns(specs)
        names = list(leaves)
        if columns is None or any(map(str.startswith, names, itertools.repeat("<NJT"))):
            dtypes: list[torch.dtype] = []
            sizes: list[int] = []
            starts: list[int] = []
            shapes: list[tuple[int, ...]] = []
            for name, spec in leaves.items():
                _dtype_name, shape, dtype, start, nbytes = self._leaf(spec, key, name)
                dtypes.append(dtype)
                sizes.append(nbytes)
                starts.append(start)
                shapes.append(tuple(shape))
            return dtypes, sizes, starts, shapes
        dtypes, sizes, starts, shapes = columns
        if all(sizes):
            self.starts += starts
            self.ends += map(operator.add, starts, sizes)
            self.labels.append((key, names))
        else:
            self.starts.extend(itertools.compress(starts, sizes))
            self.ends.extend(itertools.compress(map(operator.add, starts, sizes), sizes))
            self.labels.append((key, list(itertools.compress(names, sizes))))
        return dtypes, sizes, starts, shapes

    def _columns(
        self, specs: list[Any]
    ) -> tuple[list[torch.dtype], list[int], list[int], list[tuple[int, ...]]] | None:
        """(dtypes, bytes, starts, shapes) if every entry of ``specs`` is a usual, valid leaf, else
        None (then each is checked on its own). Dtypes and shapes are checked once per
        distinct value (a level repeats a few), the offsets column by column."""
        if set(map(type, specs)) != {list}:
            return None
        try:
            dtype_names, shapes, starts, stops, pads = zip(*specs, strict=True)
        except ValueError:  # entries of different lengths, or not of five fields
            return None
        ints = {int}
        if (
            set(map(type, dtype_names)) != {str}
            or set(map(type, shapes)) != {list}
            or set(map(type, starts)) != ints
            or set(map(type, stops)) != ints
            or set(map(type, pads)) != ints
        ):
            return None
        # The types of every dim first (a set of values would let True or 1.0 pass as 1; a
        # list in a shape could not be hashed), then the values of the distinct shapes.
        if set(map(type, itertools.chain.from_iterable(shapes))) - ints:
            return None
        count = len(specs)
        if shapes.count(shapes[0]) == count:  # one shape (equal lists of ints)
            distinct = [tuple(shapes[0])]
            shapes_t = distinct * count
        else:
            shapes_t = list(map(tuple, shapes))
            distinct = list(set(shapes_t))
        if max(map(len, distinct)) > MAX_NDIM:
            return None
        dims = set(itertools.chain.from_iterable(distinct))
        if dims and min(dims) < 0:
            return None
        if max(map(_stride_span, distinct)) > _MAX_STRIDE_SPAN:
            return None  # each leaf checked on its own says which
        names = list(set(dtype_names))
        found = list(map(DTYPES.get, names))
        if None in found:
            return None
        if len(names) == 1 and len(distinct) == 1:  # one dtype, one shape (a large level)
            shapes_t = [distinct[0]] * count  # one tuple: compared by identity later
            dtype = cast("torch.dtype", found[0])
            item = dtype.itemsize
            dtypes = [dtype] * count
            items: Any = itertools.repeat(item)
            sizes = [math.prod(distinct[0]) * item] * count
        else:
            by_name = dict(zip(names, cast("list[torch.dtype]", found), strict=True))
            dtypes = list(map(by_name.__getitem__, dtype_names))
            items = list(map(_ITEMSIZE, dtypes))
            numel = dict(zip(distinct, map(math.prod, distinct), strict=True))
            sizes = list(map(operator.mul, map(numel.__getitem__, shapes_t), items))
        if (
            min(starts) < 0
            or max(stops) > self.data_size
            or min(pads) < 0
            or max(pads) >= 8
            # (then stop >= start: sizes and pads are >= 0)
            or list(map(operator.sub, map(operator.sub, stops, starts), pads)) != sizes
            or any(map(operator.mod, starts, items))
        ):
            return None
        return dtypes, sizes, list(starts), shapes_t

    def _leaf(
        self, spec: Any, key: tuple[str, ...], name: str
    ) -> tuple[str, list[int], torch.dtype, int, int]:
        """Check one leaf entry: (dtype name, shape, dtype, start, bytes without padding)."""
        if name.startswith("<NJT"):
            raise self.fail(
                "/".join((*key, name)),
                "a nested jagged tensor; tdckpt cannot restore those from a "
                "consolidated file yet. Load it with TensorDict.from_consolidated",
                UnsupportedFormatError,
            )
        if type(spec) is list and len(spec) == 5:
            dtype_name, shape, start, stop, pad = spec
        elif type(spec) is list and len(spec) == 6:
            dtype_name, shape, start, stop, pad, _ragged = spec
        else:
            raise self.fail(
                "/".join((*key, name)), "a leaf is not [dtype, shape, start, stop, pad]"
            )
        dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if (
            dtype is None
            or type(shape) is not list
            or len(shape) > MAX_NDIM
            or type(start) is not int
            or type(stop) is not int
            or type(pad) is not int
        ):
            self._refuse_leaf(spec, key, name)
        for d in shape:
            if type(d) is not int or d < 0:
                self._refuse_leaf(spec, key, name)
        assert dtype is not None
        item = dtype.itemsize
        nbytes = math.prod(shape) * item
        if (
            _stride_span(shape) > _MAX_STRIDE_SPAN
            or not 0 <= start <= stop <= self.data_size
            or not 0 <= pad < 8
            or stop - start - pad != nbytes
            or start % item
        ):
            self._refuse_leaf(spec, key, name)
        if nbytes:
            self.starts.append(start)
            self.ends.append(start + nbytes)
            self.labels.append((key, [name]))
        return dtype_name, shape, dtype, start, nbytes

    def _refuse_leaf(self, spec: list[Any], key: tuple[str, ...], name: str) -> NoReturn:
        """Raise the error that says what is wrong with the leaf entry ``spec``."""
        shown = "/".join((*key, name))
        dtype_name, shape, start, stop, pad = spec[:5]
        dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise self.fail(shown, f"the dtype {dtype_name!r} is not a torch dtype tdckpt maps")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise self.fail(shown, f"the shape {shape!r} is not a list of sizes")
        for d in shape:
            if type(d) is not int or d < 0:
                raise self.fail(shown, f"the shape {shape!r} holds {d!r}")
        if _stride_span(shape) > _MAX_STRIDE_SPAN:
            raise self.fail(
                shown,
                f"the shape {shape!r:.200}: its dims multiply past the 2**63 - 1 a tensor's "
                "strides can hold (a zero counted as 1, as torch counts it), so no tensor of "
                "this shape can exist, even with zero elements",
            )
        for what, value in (("start", start), ("stop", stop), ("pad", pad)):
            if type(value) is not int:
                raise self.fail(shown, f"the {what} offset {value!r} is not an int")
        if not 0 <= start <= stop <= self.data_size:
            raise self.fail(
                shown,
                f"its bytes [{start}, {stop}) are not inside the {self.data_size} bytes of "
                "leaves the file holds",
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= pad < 8 or stop - start - pad != nbytes:
            raise self.fail(
                shown,
                f"its bytes [{start}, {stop}) with {pad} bytes of padding do not hold the "
                f"{nbytes} bytes of a {dtype_name} tensor of shape {shape}",
            )
        raise self.fail(shown, f"its bytes start at {start}, not aligned for {dtype_name}")

    def check_overlaps(self) -> None:
        """Refuse two leaves whose bytes overlap, naming both."""
        starts, ends = self.starts, self.ends
        if all(map(operator.le, ends, itertools.islice(starts, 1, None))):
            return  # in file order, each ending before the next starts (as tensordict writes)
        names = ["/".join((*key, name)) for key, level_names in self.labels for name in level_names]
        ranges = sorted(zip(starts, ends, names, strict=True))
        for (_s0, e0, name0), (s1, _e1, name1) in itertools.pairwise(ranges):
            if s1 < e0:
                raise self.fail(
                    name1, f"its bytes overlap those of {name0!r}; every leaf has bytes of its own"
                )
