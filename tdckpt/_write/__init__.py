"""The write path, the mirror image of the read path: plan -> write -> commit.

* ``save_plan``: what tensordict 0.15.3's ``memmap`` would write, checked before any file.
* ``save``, ``checksum``: the writer, hashing while writing, fsync, the manifest last.
* ``archive_write``: packing a directory into an aligned ``.tdz``.
* ``atomic``, ``lock``: staging names, commit by rename, the single-writer lock.
* ``export``: the public ``tdckpt.save`` of one bare prefix.
* ``preallocate``: a new file's final size set before it is written (blocks reserved where
  the file system can).
"""
