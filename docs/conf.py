"""Sphinx configuration of the tdckpt documentation.

Build (warnings are errors; the examples run against the installed tdckpt)::

    sphinx-build -W -b html docs docs/_build/html
    sphinx-build -W -b doctest docs docs/_build/doctest

No network access: no intersphinx inventories are fetched.
"""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # this checkout's tdckpt, also without an editable install
sys.path.insert(0, str(DOCS / "_ext"))

import tdckpt  # noqa: E402

project = "tdckpt"
author = "tdckpt developers"
copyright = "tdckpt developers"
release = tdckpt.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "tdckpt_docs",  # docs/_ext: `.. tdckpt-help::` prints the CLI's own --help
]

exclude_patterns = ["_build"]
root_doc = "index"
language = "en"
nitpicky = False

# -- autodoc / napoleon (Google-style docstrings) -------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# -- doctest ----------------------------------------------------------------------------------
# Only the `.. doctest::` / `.. testcode::` blocks of the pages run here; the examples in the
# docstrings run in the test suite (tests/test_doctests.py) with their modules' globals.
doctest_test_doctest_blocks = ""
# Every page's examples run in a fresh, empty working folder holding a copy of the
# checkpoint that tensordict 0.3.2 wrote (the one `tdckpt demo` restores) as ``old``.
doctest_global_setup = """
import os as _os, shutil as _shutil, tempfile as _tempfile, warnings as _warnings
from pathlib import Path as _Path
import tdckpt as _tdckpt
_cwd = _os.getcwd()
_work = _tempfile.mkdtemp(prefix="tdckpt-docs-")
_os.chdir(_work)
_shutil.copytree(_Path(_tdckpt.__file__).parent / "_demo" / "tensordict-0.3.2-nested", "old")
"""
doctest_global_cleanup = """
_os.chdir(_cwd)
_shutil.rmtree(_work, ignore_errors=True)
"""
doctest_default_flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# -- HTML ---------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"tdckpt {release}"
html_static_path: list[str] = []
