"""Restoring a validated checkpoint: plan -> apply, all or nothing.

* ``policy``: the pickle policy and its deprecation (one constant decides the flip).
* ``plan``: ready values - mapped leaves (zero-copy), non-tensor values, tensorclasses.
* ``apply``: the swap into an existing target, with its snapshot and rollback.
* ``engine``: the public ``load_memmap`` / ``load_memmap_``.
"""
