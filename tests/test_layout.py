"""The package's layout holds: no import circle between its modules, and no import from a lower floor up to a higher
one (``api`` 0, ``schedule`` 1, ``model`` / ``layout`` / ``attention`` / ``parallel`` 2, ``attention.kernels`` 3),
neither at module level nor inside a function; no private name is imported from another module. Read from the source
(``ast``), nothing is imported."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
FLOORS = {"api": 0, "schedule": 1, "model": 2, "layout": 2, "attention": 2, "parallel": 2}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in (SRC / "sharedprefix").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(mods) -> dict[str, tuple[set[str], set[str]]]:
    """module -> (its module-level imports of the package's modules, those inside functions)."""
    out = {}
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        top: set[str] = set()
        inner: set[str] = set()
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sharedprefix"):
                names = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names
                ]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name in mods]
            (top if node in tree.body else inner).update(n for n in names if n in mods and n != m)
        out[m] = (top, inner)
    return out


def _floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[1:3] == ["attention", "kernels"]:
        return 3
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def test_no_import_circle():
    mods = _modules()
    edges = {m: top for m, (top, _) in _imports(mods).items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(m, path):
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                circles.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


def test_no_import_up_a_floor():
    ups = []
    for m, (top, inner) in _imports(_modules()).items():
        for n in top | inner:
            a, b = _floor(m), _floor(n)
            if a is not None and b is not None and b < a:
                ups.append(f"{m} -> {n}")
    assert not ups, ups


def test_no_private_name_imported_across_modules():
    """A name with a leading underscore stays in its module: what another module needs is public."""
    found = []
    for m, p in _modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sharedprefix"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                found += [f"{m}: {node.module}.{name}" for name in private]
    assert not found, found


def test_no_core_module_over_300_lines():
    """The core (``api``, ``schedule``, ``model``, ``layout``, ``attention``, ``parallel``) reads in modules of at most
    300 lines; a longer one is split by concept."""
    long = {}
    for m, p in _modules().items():
        if _floor(m) is not None and (n := len(p.read_text().splitlines())) > 300:
            long[m] = n
    assert not long, long
