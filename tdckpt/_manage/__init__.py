"""What ``CheckpointManager`` builds on besides the write path.

* ``steps``: the steps of a root - listing, manifests, which step a request means.
* ``verify``: re-reading a step against its manifest's sizes and checksums.
* ``pins``: the steps being read (kept from retention) or overwritten (reads wait).
* ``reader``: the bodies of ``restore_into`` and ``restore`` - a pinned step, opened,
  checked and handed to the restore engine or the shard layer.
* ``saver``: the body of a save - claim, write, commit - and retention after it.
* ``background``: ``save_async``'s thread; ``schedule``: ``should_save``.
"""
