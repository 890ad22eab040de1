"""A whole training state through the manager: modules, optimizers, schedulers, generators.

* :mod:`~tdckpt._state.encode`: :func:`to_tensordict` turns a mapping of names to live
  objects into one TensorDict (tensors as leaves, plain values as JSON non-tensor data,
  pickles only for what is not JSON data) plus the manifest's record of what each entry was.
* :mod:`~tdckpt._state.decode`: :func:`to_state_dicts` reads each entry's saved structure back
  into the ``state_dict`` it was.
* :mod:`~tdckpt._state.restore`: :func:`restore_state` checks every entry against a saved
  step before the first ``load_state_dict``, restores each in place, and puts back the
  entries already restored if a later one fails.
* :mod:`~tdckpt._state.rng`: :class:`RandomState`, the state of every random generator.
"""

from tdckpt._state.decode import to_state_dicts
from tdckpt._state.encode import holds_live_objects, is_state_mapping, to_tensordict
from tdckpt._state.restore import restore_state
from tdckpt._state.rng import RandomState

__all__ = [
    "RandomState",
    "holds_live_objects",
    "is_state_mapping",
    "restore_state",
    "to_state_dicts",
    "to_tensordict",
]
