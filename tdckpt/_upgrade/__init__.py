"""Upgrading a checkpoint on disk: plan on the read path, then a crash-safe swap.

* ``upgrade``: the plan (the same migrations as an in-memory read) and ``tdckpt.upgrade``.
* ``convert``: ``convert_pickles`` - plain pickled values rewritten as JSON.
* ``plan``: the plan and the report, the types both of the others speak.
* ``journal``: staging (leaves copied or reflinked), the journal, the swap with a backup, recovery.
"""
