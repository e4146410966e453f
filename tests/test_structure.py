"""The package stays readable as it grows (issue 53): modules of about 500 lines at most (data
tables aside), and no function a caller could hand a long row of arguments to swap."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import certkv

PACKAGE = Path(certkv.__file__).parent
MAX_LINES = 520  # "about 500"
DATA_TABLES = {"eval/ruler.py"}  # RULER's word lists and templates: data, not logic
MAX_PARAMETERS = 10  # keyword-only options included
MAX_POSITIONAL = 8
# compiled kernels take flat arrays and scalars (their ABI: no objects cross into numba or
# Triton); typer commands take one parameter per command-line option; a constructor takes its
# options (by keyword, with defaults)
EXEMPT_DECORATORS = ("jit", "command")
CONSTRUCTORS = {"__init__", "build"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_much_over_500_lines_except_data_tables():
    long = {str(p.relative_to(PACKAGE)): n for p in modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= DATA_TABLES, long


def _parameters(fn: ast.FunctionDef) -> tuple[int, int]:
    """(all parameters, positional ones), without ``self`` / ``cls``."""
    a = fn.args
    positional = len(a.posonlyargs) + len(a.args)
    if a.args and a.args[0].arg in ("self", "cls"):
        positional -= 1
    return positional + len(a.kwonlyargs), positional


def test_no_function_takes_a_long_row_of_arguments():
    """At most 8 positional parameters and 10 in all (constructors' keyword options aside),
    except compiled kernels and command-line commands."""
    over = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            decorators = " ".join(ast.unparse(d) for d in node.decorator_list)
            if any(word in decorators for word in EXEMPT_DECORATORS):
                continue
            total, positional = _parameters(node)
            limit = math.inf if node.name in CONSTRUCTORS else MAX_PARAMETERS
            if (positional > MAX_POSITIONAL and node.name not in CONSTRUCTORS) or total > limit:
                over.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: "
                            f"{total} parameters, {positional} positional")
    assert not over, "\n".join(over)


def test_the_checks_above_see_what_they_check():
    """Not vacuous: the walk finds the package's modules and its long kernels (exempt)."""
    assert len(modules()) > 50
    kernel = PACKAGE / "kernels" / "triton_score.py"
    fns = {n.name: n for n in ast.walk(ast.parse(kernel.read_text()))
           if isinstance(n, ast.FunctionDef)}
    assert _parameters(fns["_score_kernel"])[0] > MAX_PARAMETERS



def test_test_directories_mirror_the_package():
    """``tests/<package>/`` holds the tests of ``certkv/<package>/``; tests across packages (the
    contract, the CLI, the docs) sit at the top, shared code in ``tests/helpers``, reference
    data in ``tests/data``."""
    tests = Path(__file__).parent
    dirs = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    shared = {"helpers", "data"}
    assert dirs - shared <= packages and len(dirs) > 5
    for d in dirs - shared:
        assert list((tests / d).glob("test_*.py")), d
