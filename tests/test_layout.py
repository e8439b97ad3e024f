"""The package's layout holds: no import circle between its modules, and no import from a lower floor up to a higher
one (``api`` 0, ``schedule`` 1, ``model`` / ``layout`` / ``attention`` / ``parallel`` 2, ``attention.kernels`` 3),
neither at module level nor inside a function; no private name is imported from another module; no test file imports
another. Read from the source (``ast``), nothing is imported."""

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


# -- the import graph ----------------------------------------------------------------------------------------------
# Every import of the package counts, wherever it is written: at module level, inside a function, under
# ``TYPE_CHECKING``. Its edge goes to the module that defines what is imported:
# - ``from a.b import c`` and ``a.b.c`` a module: to ``a.b.c``;
# - ``from a.b import name``, ``a.b`` a package whose ``__init__`` imports ``name`` from ``a.b.m`` (a re-export, at
#   any depth of the ``__init__``): to ``a.b.m`` (followed through further re-exports); otherwise to ``a.b``;
# - ``import a.b as x`` (or ``import a``): to the module each ``x.name`` / ``a.b.name`` used in the file resolves to
#   as above, and to ``a.b`` itself when the file uses no attribute of it;
# - relative imports are made absolute first.
# An ``__init__`` that only re-exports is a doorway, not a dependency: it is not counted when its package's modules
# import each other, and the package ``__init__``s that Python runs on the way to a module are not counted either.
# A module imported by name at run time (``importlib.import_module("...")``, a plugin) is no edge: that is how a
# module lower down reaches one that registers itself.


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module name of ``from ... import`` in ``module``."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _import_graph(sources: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    """module -> the package's modules it imports (the rule above); ``sources``: module name -> its source."""
    trees = {m: ast.parse(s) for m, s in sources.items()}
    reexports: dict[str, dict[str, tuple[str, str]]] = {}  # package -> name -> (module it is imported from, name)
    for m in packages:
        for node in ast.walk(trees[m]):
            if isinstance(node, ast.ImportFrom):
                origin = _absolute(node, m, True)
                for a in node.names:
                    reexports.setdefault(m, {})[a.asname or a.name] = (origin, a.name)

    def target(module: str, name: str, seen: frozenset = frozenset()) -> str:
        if f"{module}.{name}" in sources:
            return f"{module}.{name}"
        origin, origin_name = reexports.get(module, {}).get(name, ("", ""))
        if origin in sources and origin not in seen:
            return target(origin, origin_name, seen | {module})
        return module

    def longest_module(dotted: list[str]) -> int:
        return max((i for i in range(1, len(dotted) + 1) if ".".join(dotted[:i]) in sources), default=0)

    graph: dict[str, set[str]] = {}
    for m, tree in trees.items():
        edges: set[str] = set()
        bound: dict[str, str] = {}  # a name ``import`` binds -> the module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                origin = _absolute(node, m, m in packages)
                if origin in sources:
                    edges.update(target(origin, a.name) for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    if a.name not in sources:
                        continue
                    if a.asname:
                        bound[a.asname] = a.name
                    else:  # ``import a.b`` binds ``a`` and imports ``a.b``
                        bound[top] = top
                        edges.update({a.name} - {top})
        used: set[str] = set()
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in inner:
                chain = []
                cur: ast.expr = node
                while isinstance(cur, ast.Attribute):
                    chain.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name) and cur.id in bound:
                    dotted = bound[cur.id].split(".") + chain[::-1]
                    i = longest_module(dotted)
                    if i:
                        used.add(cur.id)
                        module = ".".join(dotted[:i])
                        edges.add(target(module, dotted[i]) if i < len(dotted) else module)
        edges.update(bound[b] for b in bound if b not in used and bound[b] in sources)
        graph[m] = edges - {m}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """One circle per strongly connected group of modules, written ``a -> b -> a``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n not in index:
                connect(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while True:
                n = stack.pop()
                group.append(n)
                if n == m:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for m in sorted(graph):
        if m not in index:
            connect(m)
    circles = []
    for group in groups:  # the shortest way from the group's first module back to it
        start, inside = group[0], set(group)
        paths = {start: [start]}
        queue = [start]
        circle: list[str] = []
        while queue and not circle:
            m = queue.pop(0)
            for n in sorted(graph[m] & inside):
                if n == start:
                    circle = paths[m] + [start]
                    break
                if n not in paths:
                    paths[n] = paths[m] + [n]
                    queue.append(n)
        circles.append(" -> ".join(circle))
    return circles


def _package_graph() -> dict[str, set[str]]:
    mods = _modules()
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    return _import_graph({m: p.read_text() for m, p in mods.items()}, packages)


def _floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[1:3] == ["attention", "kernels"]:
        return 3
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def test_circle_rule_catches_planted_circles():
    """The rule on a made-up package: a circle through a function's import and one under ``TYPE_CHECKING``, one
    through a relative import and a re-exporting ``__init__``, none where the ``__init__`` is only a doorway."""
    sources = {
        "p": "",
        "p.a": "def f():\n    from p.b import g\n",
        "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import f\ndef g(): ...\n",
        "q": "from q.c import h\n",
        "q.c": "from . import d\ndef h(): ...\n",
        "q.d": "import q as pkg\nx = pkg.h\n",
        "r": "from r.e import k\nfrom r.f import m\n",
        "r.e": "from r import m\nk = 1\n",
        "r.f": "m = 2\n",
    }
    graph = _import_graph(sources, {"p", "q", "r"})
    assert graph["q.d"] == {"q.c"} and graph["r.e"] == {"r.f"}, graph
    assert _circles(graph) == ["p.a -> p.b -> p.a", "q.c -> q.d -> q.c"]


def test_no_import_circle():
    circles = _circles(_package_graph())
    assert not circles, circles


def test_no_import_up_a_floor():
    ups = []
    for m, imported in _package_graph().items():
        for n in imported:
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


TESTS = pathlib.Path(__file__).resolve().parent


def _test_file_imports(source: str) -> list[str]:
    """The test modules (``test_*``) that ``source`` imports: shared helpers live in ``tests/helpers.py`` and
    ``tests/support/``, never in another test file (importing one runs its module-level set-up and couples the two)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [n for n in names if n.split(".")[-1].startswith("test_")]
    return found


def test_test_import_rule_catches_planted_imports():
    planted = [
        "from tests.gpu.test_cuda import MODELS",
        "from test_backward import _run",
        "import tests.schedule.test_backward as tb",
        "from .test_cuda import x",
        "from tests.gpu import test_cuda",
    ]
    for source in planted:
        assert _test_file_imports(source), source
    assert _test_file_imports("from helpers import tiny_model\nfrom support.bf16 import MODELS") == []


def test_no_test_file_imports_another():
    found = {}
    for p in TESTS.rglob("*.py"):
        if hits := _test_file_imports(p.read_text()):
            found[str(p.relative_to(TESTS))] = hits
    assert not found, found


def test_one_way_to_mark_a_slow_test():
    """A slow test carries ``pytest.mark.slow`` where it is written (decorator, module ``pytestmark``,
    ``pytest.param(marks=...)``): no hook adds marks by name, where a rename would drop one silently. The one
    collection hook (``tests/conftest.py``: the order of the tests under pytest-xdist) touches no mark."""
    found = []
    for p in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "pytest_collection_modifyitems":
                if p != TESTS / "conftest.py":
                    found.append(f"{p.relative_to(TESTS)}: defines pytest_collection_modifyitems")
            elif isinstance(node, ast.Attribute) and node.attr in ("add_marker", "own_markers"):
                found.append(f"{p.relative_to(TESTS)}:{node.lineno}: {node.attr}")
    assert not found, found


# Test files that still spell out transformers configs, each for a reason tiny_model() and the zoo do not cover; the
# number of config constructions in each is fixed, so that a new one fails here (and a removed one updates the count).
CONFIG_ALLOWED = {
    "cli/test_train.py": (1, "a ViT config for an image processor's folder, no causal LM"),
    "model/test_registry.py": (1, "a subclass of LFM2's config registered under a new name: the registry is the test"),
    "model/test_hybrid_edges.py": (3, "vision-language composites (LFM2-VL, LFM3-VL, MiniCPM-V 4.6) sized by hand"),
    "integrations/test_trl_llava_next.py": (3, "LLaVA-NeXT with its CLIP tower sized for its tiles"),
    "integrations/test_trl_vl_train.py": (2, "LLaVA-NeXT and Qwen2-VL composites saved for TRL's processors"),
    "integrations/test_trl_refusals.py": (1, "a Qwen3.5 vision-language model around a text config"),
    "integrations/test_verl.py": (1, "saved for verl, run in verl's own environment (older transformers)"),
    "integrations/test_verl_hybrid.py": (4, "saved for verl, run in verl's own environment (older transformers)"),
    "integrations/verl_support.py": (4, "saved for verl, run in verl's own environment (older transformers)"),
}


def _config_calls(source: str, is_config) -> list[str]:
    """The transformers config classes ``source`` names (``tf.Qwen3Config(...)``, ``Qwen3Config``, a class handed to
    a builder): each a config spelled out in the test."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
        if name.endswith("Config") and is_config(name):
            found.append(f"line {node.lineno}: {name}")
    return found


def _is_transformers_config(name: str) -> bool:
    import transformers

    cls = getattr(transformers, name, None)
    base = transformers.PretrainedConfig
    return isinstance(cls, type) and issubclass(cls, base) and cls is not base


def test_config_rule_catches_planted_configs():
    source = "cfg = tf.Qwen3Config(hidden_size=32)\nc = Gemma2Config()\nx = LoraConfig(r=4)\ny = TrainConfig()\n"
    source += "m = build(tf.MambaConfig, state_size=8)"
    want = ["line 1: Qwen3Config", "line 2: Gemma2Config", "line 5: MambaConfig"]
    assert _config_calls(source, _is_transformers_config) == want


def test_tiny_models_come_from_tiny_model_or_the_zoo():
    """A test builds its tiny model with ``helpers.tiny_model(model_type, **overrides)`` (the zoo's tiny config,
    ``sharedprefix.tools.zoo``), so that sizes live in one place; only ``helpers.py`` and ``support/`` (the shared
    builders) construct transformers configs, and the files of ``CONFIG_ALLOWED`` for their reasons."""
    found = {}
    for p in TESTS.rglob("*.py"):
        rel = str(p.relative_to(TESTS))
        if rel == "helpers.py" or rel.startswith("support/"):
            continue
        calls = _config_calls(p.read_text(), _is_transformers_config)
        if len(calls) != CONFIG_ALLOWED.get(rel, (0, ""))[0]:
            found[rel] = calls
    assert not found, found
