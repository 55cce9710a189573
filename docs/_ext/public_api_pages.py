"""The ``public-api`` directive: one public package's reference, every name of its ``__all__``.

``automodule`` with the package's ``__all__`` documents the classes and functions it
re-exports, but skips a re-exported constant or type alias (``BlockTable``, ``MAGIC``): autodoc
finds a variable's doc comment only in the module that assigns it. The directive documents
those with ``autodata``, and the docstring hook below gives each the doc comment of the module
that defines it instead of the docstring of its type (``tuple``, ``str``, ``NewType``), which
autodoc would print otherwise.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective


def _is_data(value: object) -> bool:
    return not (inspect.isclass(value) or inspect.isroutine(value) or inspect.ismodule(value))


class PublicApi(SphinxDirective):
    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        module = importlib.import_module(name)
        data = [n for n in module.__all__ if _is_data(getattr(module, n))]
        lines = [f".. automodule:: {name}", "   :no-ignore-module-all:", "   :undoc-members:"]
        if data:
            lines.append(f"   :exclude-members: {', '.join(data)}")
        for entry in data:
            lines += ["", f".. autodata:: {name}.{entry}"]
        return self.parse_text_to_nodes("\n".join(lines))


def _borrowed(obj: object) -> bool:
    """Whether ``obj``'s docstring is that of what it is an instance or alias of."""
    own = getattr(obj, "__doc__", None)
    owners = (type(obj), getattr(obj, "__origin__", None), typing.NewType)
    return own is None or any(own == getattr(owner, "__doc__", None) for owner in owners)


def _defining_comment(package: str, name: str) -> list[str]:
    """The doc comment of ``name`` in the module of ``package`` that assigns it."""
    for modname in sorted(m for m in sys.modules if m == package or m.startswith(package + ".")):
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except PycodeError:
            continue
        if ("", name) in docs:
            return list(docs[("", name)])
    return []


def _own_docs(  # noqa: PLR0917  (autodoc-process-docstring's signature)
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    if what != "data" or not _borrowed(obj):
        return
    package, _, short = name.rpartition(".")
    lines[:] = _defining_comment(package, short)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("public-api", PublicApi)
    # After napoleon (priority 500): a doc comment such as "Block ids of one request: one row
    # per group" is prose, which napoleon would read as "type: description".
    app.connect("autodoc-process-docstring", _own_docs, priority=600)
    return {"parallel_read_safe": True}
