"""The read path, one direction (design.md).

storage -> metadata -> detect -> migrate -> names -> validate.

* ``storage``, ``archive``, ``archive_index``: one read-only interface over a directory or a
  ``.tdz`` archive that refuses anything leaving the prefix and never writes.
* ``tree``: the metadata stage - every ``meta.json`` (or ``meta.pt``) read into a virtual tree.
* ``detect``, ``migrate`` (+ the scripts in ``migrations/``): which generation wrote each
  directory, and the in-memory upgrade of the tree to the current format.
* ``names``: which file holds each key (robust / legacy names, decided per directory).
* ``nodes``, ``validate`` (+ ``views`` for sub-tensordicts and lazy views): the typed tree
  and every problem, collected at once.
* ``pipeline``: the stages chained (``open_checkpoint``); ``inspect``: ``validate``/``inspect``.
* ``lane``: a restore's read of a tree in the exact current form (``open_current``): the same
  storage calls and the same validation, without the detect, migrate and names stages that
  provably change nothing there; it declines anything else (the restore then takes
  ``open_checkpoint``). ``lane_prune``: a selective restore's keys applied on the lane right
  after the metadata is read, so only the selected part is validated and mapped.
"""
