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


# A read of an engine's kind: a flag named after an engine (``par.fsdp``), the kind or the composed degrees read off
# the engine (``par.kind``, ``run.par.tensor``), a comparison with an engine's name (``== "ddp"``), or an engine class
# itself (imported from ``parallel.engines``, for ``isinstance``). The schedule asks the engine instead.
ENGINE_FLAGS = {"fsdp", "ddp", "is_fsdp", "is_ddp"}
ENGINE_FIELDS = {"kind", "tensor", "data_group", "data_size", "world_size", "root"}
ENGINE_NAMES = {"ddp", "fsdp", "fsdp2", "single", "deepspeed", "zero"}


def _engine_branches(source: str) -> list[str]:
    """Where ``source`` (a module outside ``parallel``) branches on an engine kind instead of asking the engine."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
            if node.attr in ENGINE_FLAGS or (owner in ("par", "engine") and node.attr in ENGINE_FIELDS):
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Compare):
            for c in [node.left, *node.comparators]:
                items = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                names = [x.value for x in items if isinstance(x, ast.Constant) and isinstance(x.value, str)]
                found += [f"line {node.lineno}: compared with {n!r}" for n in names if n.lower() in ENGINE_NAMES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sharedprefix.parallel.engines"):
            found.append(f"line {node.lineno}: imports {node.module}")
    return found


def test_engine_branch_rule_catches_planted_branches():
    planted = {
        'if par.kind == "ddp":\n    pass': 2,  # the kind read, and compared with a name
        "x = 1 if run.par.fsdp else 0": 1,
        "if self.par.tensor > 1:\n    pass": 1,
        'if kind in ("fsdp", "none"):\n    pass': 1,
        "from sharedprefix.parallel.engines.ddp import DDP": 1,
    }
    for source, n in planted.items():
        assert len(_engine_branches(source)) == n, (source, _engine_branches(source))
    clean = 'if pat.kind == "sliding":\n    pass\nif par.lockstep:\n    par.agree_on_error(None)\nx = par.sequence'
    assert _engine_branches(clean) == []


def test_no_engine_branch_outside_parallel():
    """Outside ``parallel`` the core asks the call's engine (``parallel.engine.Engine``) what to do; it never branches
    on which engine it is, so that adding an engine is one module under ``parallel/engines/`` and one registration."""
    found = {}
    for m, p in _modules().items():
        if _floor(m) is not None and m.split(".")[1] != "parallel" and (hits := _engine_branches(p.read_text())):
            found[m] = hits
    assert not found, found
