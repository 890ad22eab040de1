"""``python -m tdckpt``: the command line."""

import sys

try:
    from tdckpt.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch is still being imported
    sys.stderr.write("error: interrupted (Ctrl-C).\n")
    sys.exit(130)
except Exception as exc:  # a broken installation: say so in one line
    if "--traceback" in sys.argv:
        raise
    sys.stderr.write(
        f"error: tdckpt cannot start ({type(exc).__name__}: {exc}); its installation or one "
        "of its dependencies (torch, tensordict) is broken. Reinstall them, or rerun with "
        "--traceback for details.\n"
    )
    sys.exit(2)

sys.exit(main())
