"""G6 -> G7: tensordict 0.15.0 - 0.15.2 (sets pickled, clean ``_metadata``, ``json_types.json``).

What changed in tensordict 0.15.0 (read from the wheels; format-notes.md G7):

* sets are no longer treated as JSON: they are pickled (up to 0.14 a set passed the JSON
  check and then failed the save, so no older checkpoint holds one);
* the ``_metadata`` of a NonTensorData is stripped of its memmap bookkeeping. From 0.5 to
  0.14, saving a NonTensorData that had already been memmapped put
  ``{'_metadata': {'memmap_prefix': PosixPath(...), ...}}`` into ``other.pickle`` beside an
  innocuous inline value - a pickle that ``allow_pickle=False`` then refuses;
* ``json_types.json`` (``{"types": ..., "pickle_sha256": ...}``) describes a pickle that
  holds only container types, so it can be read without unpickling; older readers still use
  the pickle;
* the pickle FutureWarning (#1763, #1764) now announces ``allow_pickle=False`` for 0.16;
* 0.15.2 drops orjson (gh-2913): files are stdlib-json again (spaces, ``NaN`` tokens).

What this step does: nothing to the metadata - every G6 file is valid G7. It points out
the accidental ``_metadata`` pickles (an inline ``data`` value, no ``_metadata`` entry, an
``other.pickle`` beside them): only unpickling can confirm and remove them, which
``tdckpt upgrade --convert-pickles`` does for a trusted checkpoint. ``json_types.json`` is
not synthesized: writing it needs the pickle's content.
"""

from __future__ import annotations

from tdckpt._read.migrate import MigrationContext, VDir, level_kind

FROM_VERSION = 6
TO_VERSION = 7


def upgrade(tree: VDir, ctx: MigrationContext) -> VDir:
    for target in ctx.targets(tree):
        meta = target.node.meta
        if meta is None or level_kind(meta) != "non-tensor":
            continue
        if "data" in meta and "_metadata" not in meta and "other.pickle" in target.node.files:
            ctx.problem(
                "metadata-pickle",
                "info",
                target,
                "other.pickle beside an inline value probably holds only the memmap "
                "bookkeeping that tensordict 0.5-0.14 pickled by accident (`_metadata`); it "
                "makes allow_pickle=False refuse this checkpoint. On a trusted copy, "
                "`tdckpt upgrade --convert-pickles` replaces it with `_metadata: null`.",
            )
    return tree
