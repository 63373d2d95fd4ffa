"""The package's layering (pyproject.toml's import-linter contract) and no import cycles
between its modules."""

import pathlib
import subprocess
import sys

import grimp
import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_layering_contract_holds():
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("purinec", exclude_type_checking_imports=True)
    imports = nx.DiGraph()
    for module in graph.modules:
        imports.add_node(module)
        imports.add_edges_from((module, other)
                               for other in graph.find_modules_directly_imported_by(module))
    assert [cycle for cycle in nx.simple_cycles(imports)] == []
