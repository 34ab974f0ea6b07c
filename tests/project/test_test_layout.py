"""The test tree's own layout: pytest puts ``tests/`` on ``sys.path`` (rootdir conftest), so a concern folder named
like an importable package would shadow it as a namespace package where that package is not installed — a
``tests/gguf/`` folder made ``import gguf`` succeed without the gguf extra, and 37 GGUF tests failed instead of
skipping. Folders here must not take the name of a package localdiff or its tests import."""

import ast
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def _imported_top_names() -> set[str]:
    names = set(sys.stdlib_module_names)
    for p in [*ROOT.joinpath("localdiff").rglob("*.py"), *TESTS.rglob("*.py")]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("need", "_need", "importorskip"):
                names |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return names


def test_no_test_folder_shadows_a_package():
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    own = {p.stem for p in TESTS.joinpath("helpers").glob("*.py")}  # helper modules are imported by design
    clash = sorted(folders & (_imported_top_names() - own - {"tests"}))
    assert not clash, f"tests/ folders named like imported packages: {clash}"


def test_the_check_knows_the_optional_extras():
    assert {"gguf", "llama_cpp", "torch"} <= _imported_top_names()
