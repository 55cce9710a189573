"""Sphinx configuration for the hybridkv design reference."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
# docs/_ext: the public-api directive of the API reference pages (reference/api).
sys.path.insert(0, os.path.abspath("_ext"))

project = "hybridkv"
author = "hybridkv developers"
copyright = "2026, hybridkv developers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "public_api_pages",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# ignore-module-all: document each object where it is defined, not again where it is re-exported;
# the public packages' pages (reference/api) document their __all__ with the public-api directive.
autodoc_default_options = {
    "members": True,
    "undoc-members": False,
    "show-inheritance": True,
    "ignore-module-all": True,
}
autodoc_mock_imports = ["vllm"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections become :ivar: fields, so a dataclass field is not described twice.
napoleon_use_ivar = True
# Type hints name classes by their short name; two models legitimately define a GroupSpec
# (the geometry's and the managers'), and an ambiguous short name is not a broken link.
suppress_warnings = ["ref.python"]
nitpicky = False

html_theme = "furo"
html_title = "hybridkv"
html_static_path = ["_static"]
