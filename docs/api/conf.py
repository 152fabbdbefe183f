"""Sphinx configuration of metamat's API reference (``make docs``: HTML into build/docs)."""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

import metamat  # noqa: E402

project = "metamat"
author = "metamat developers"
copyright = "metamat developers"
release = version = metamat.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]
autosummary_generate = False  # the pages list their entries themselves: nothing is written here
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Optional packages some members mention; the reference builds without them.
autodoc_mock_imports = [m for m in ("torchrec", "fbgemm_gpu", "obstore", "transformers")
                        if __import__("importlib").util.find_spec(m) is None]
intersphinx_mapping = {}  # offline: no inventories are fetched
nitpicky = False
suppress_warnings = ["config.cache"]

html_theme = "furo"
html_title = f"metamat {release}"
exclude_patterns = ["_build"]
