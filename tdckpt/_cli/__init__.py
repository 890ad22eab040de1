"""The parts of the ``tdckpt`` command line (:mod:`tdckpt.cli` assembles them): what it
writes (``output``), its argument types (``args``), the commands on one checkpoint prefix
(``prefix``) and on a root of managed steps (``root``)."""
