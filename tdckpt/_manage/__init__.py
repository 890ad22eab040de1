"""What ``CheckpointManager`` builds on besides the write path.

* ``steps``: the steps of a root - listing, manifests, which step a request means.
* ``verify``: re-reading a step against its manifest's sizes and checksums.
"""
