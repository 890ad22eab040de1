"""Sharded steps: a collective save and resharded restores across torch.distributed ranks.

``group`` (tdckpt's gloo group), ``save`` (the save protocol), ``manifest`` (the step
manifest and rank 0's coverage check), ``rows`` (row planning and reads of the requested
rows only) and ``restore`` (the manager's restore hooks). See docs/distributed.rst.
"""
