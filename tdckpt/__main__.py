"""``python -m tdckpt``: the command line."""

import sys

from tdckpt.cli import main

sys.exit(main())
