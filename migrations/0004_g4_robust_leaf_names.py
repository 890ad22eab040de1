"""G4 -> G5: percent-encoded leaf file names became the default (tensordict 0.13.0).

What changed: up to 0.10 a leaf ``key`` was always stored as the raw ``<key>.memmap``,
which breaks for keys such as ``"a/b"`` (issue #1440). 0.11.0 added an opt-in
``robust_key=True`` (PR #1443) that percent-encodes unsafe characters (``a b`` ->
``a%20b.memmap``), with a FutureWarning on the default; 0.13.0 made it the default
(PR #1717) for leaf files. Directory names stayed raw until 0.14 (next step). The
meta.json keys were always the raw keys, so the metadata itself did not change.

What this step does: nothing to the metadata. The file names are not touched here: the
names stage (:mod:`tdckpt._read.names`) maps every key to its file after the chain, deciding
the convention per directory. For a G4 directory the leaf convention cannot be known from
the version alone (0.5-0.10 wrote raw names, 0.11-0.12 raw by default or encoded with
``robust_key=True``), so ``leaf_encoding`` stays as earlier steps left it: ``"legacy"``
for directories that came from 0.4 or older, ``None`` (decide from what is on disk, refuse
when both names exist) for 0.5-0.12 ones.
"""

from __future__ import annotations

from tdckpt._read.migrate import MigrationContext, VDir

FROM_VERSION = 4
TO_VERSION = 5


def upgrade(tree: VDir, ctx: MigrationContext) -> VDir:
    # Metadata is unchanged between G4 and G5; the leaf-name hint is left as it is (see the
    # module docstring), so the names stage decides the convention from the files.
    return tree
