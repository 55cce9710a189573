"""import-linter contract type ``public_api``: an importer uses hybridkv's public names only.

Registered in pyproject.toml (``[tool.importlinter] contract_types``) and run by ``lint-imports``
in ``nox -s lint`` (which puts the checkout on ``sys.path``, so ``tools`` imports from it).
The built-in types see modules, not names: ``forbidden`` could refuse ``hybridkv.store.manager``
but not ``from hybridkv.store import _Private``. This one reads each importer's source
(:func:`tools.public_api.check_source`) against docs/reference/api/public-names.txt, which
tests/test_public_api.py holds equal to the live ``__all__``s.

Options:

- ``importers``: packages (each with its descendants) whose imports are checked. One that is not
  in the graph yet (the package is not written) is a warning, not a failure.
- ``public_names``: the list's path, relative to the directory ``lint-imports`` runs in.
- ``root``: the package the list governs (default ``hybridkv``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck

from tools.public_api import Violation, check_source, read_public_names


class PublicApiContract(Contract):
    type_name = "public_api"

    importers = fields.ListField(subfield=fields.StringField())
    public_names = fields.StringField()
    root = fields.StringField(default="hybridkv")

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        public = read_public_names(Path(str(self.public_names)))
        root = str(self.root)
        violations: list[Violation] = []
        warnings: list[str] = []
        checked = 0
        for own in self.importers:  # type: ignore[attr-defined]
            if own not in graph.modules:
                warnings.append(f"{own} is not in the import graph (not written yet?): unchecked")
                continue
            for module in sorted({own, *graph.find_descendants(own)}):
                found = _source_of(module)
                if found is None:
                    continue  # a namespace package's folder: no source of its own
                path, is_package = found
                source = path.read_text(encoding="utf-8")
                violations += check_source(
                    module,
                    source,
                    is_package=is_package,
                    public=public,
                    own=own,
                    root=root,
                    is_module=lambda name: name in graph.modules,
                )
                checked += 1
        output.verbose_print(verbose, f"public_api: {checked} modules read")
        return ContractCheck(
            kept=not violations,
            warnings=warnings,
            metadata={"violations": [str(v) for v in violations]},
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error("These imports reach names outside hybridkv's public API:", bold=False)
        output.new_line()
        for line in check.metadata["violations"]:
            output.print_error(f"- {line}", bold=False)
        output.new_line()
        output.print_error(
            "Import the name from its public package (its __all__, listed in "
            f"{self.public_names}), or make it public there first: add it to the package's "
            "__all__ and to the list (tests/test_public_api.py checks the two agree).",
            bold=False,
        )


def _source_of(module: str) -> tuple[Path, bool] | None:
    """The file of ``module`` and whether it is a package, found from its top package's folder
    (finding a submodule's spec would import its parents, which may need vLLM or torch); None
    for a namespace package's folder."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{top} is not an importable package: cannot read {module}")
    for base in spec.submodule_search_locations:
        folder = Path(base).joinpath(*rest)
        if (folder / "__init__.py").is_file():
            return folder / "__init__.py", True
        if rest and folder.with_suffix(".py").is_file():
            return folder.with_suffix(".py"), False
        if folder.is_dir():
            return None
    raise ValueError(f"no source file for {module} under {top}")
