"""The tree's shape, held: packages import only downwards (engine <- costmodel <- pipeline <- bench <- batchgen),
inside engine/ its parts import only downwards too (``ENGINE_ORDER``), no two modules import each other (directly
or round a longer loop), imports inside functions included and those under ``if TYPE_CHECKING:`` aside everywhere,
no Python file over 500 lines, and a README that stays a door (<= 15,000 bytes).

Each rule is checked on the real tree and, so the check itself can fail, on a small tree that breaks it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Lower rank first: a module may import its own package and packages of lower rank only.
LAYERS = ("engine", "costmodel", "pipeline", "bench", "batchgen")
MAX_LINES = 500
# engine/'s parts (a top-level module, or a subpackage with all its modules), lowest first: a part imports only
# itself and parts listed before it. "__init__" is the package's own door (engine/__init__.py).
ENGINE_ORDER = (
    "errors", "cache_root", "outputs", "scheduler_output", "omp_wait", "cpu_tuning",    # plain records, no deps
    "kernels", "dtype_policy", "invariance",                                              # the machine
    "config", "structured", "sampling_params", "request", "detokenizer", "interface",     # what is asked
    "block_pool", "kv_cache_manager", "scheduler",                                        # who computes what
    "quant", "attention", "models", "loader", "tokenizer", "memory",                      # the model
    "sample", "spec_decode", "model_runner",                                              # one step's compute
    "tuning", "setup", "llm", "__init__",                                                 # start-up, the door
)
README_MAX_BYTES = 15_000


def _modules(root: Path, packages) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir() else ():
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def import_graph(root: Path, packages=LAYERS) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (anywhere in the file: function bodies too).

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``."""
    mods = _modules(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:      # `import a.b.c.func`-style names: the module part
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    rank = {pkg: i for i, pkg in enumerate(layers)}
    return sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                  if rank[t.split(".")[0]] > rank[m.split(".")[0]])


def part_of(module: str) -> str:
    """``engine.sample.sampler`` -> ``sample``; ``engine.llm`` -> ``llm``; ``engine`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def backward_imports(graph: dict[str, set[str]], order=ENGINE_ORDER, package: str = "engine") -> list[str]:
    """Imports inside ``package`` from one part to a part listed after it in ``order``, and modules of a part
    ``order`` does not list."""
    rank = {part: i for i, part in enumerate(order)}
    inside = {m: targets for m, targets in graph.items() if m.split(".")[0] == package}
    found = [f"{m}: its part {part_of(m)!r} has no rank" for m in inside if part_of(m) not in rank]
    found += [f"{m} imports {t}" for m, targets in inside.items() for t in targets
              if t.split(".")[0] == package and part_of(m) in rank and part_of(t) != part_of(m)
              and rank.get(part_of(t), -1) > rank[part_of(m)]]
    return sorted(found)


def long_files(root: Path, limit: int = MAX_LINES) -> list[str]:
    paths = [p for d in (*LAYERS, "tests", "sample_data") for p in (root / d).rglob("*.py")]
    return sorted(f"{p.relative_to(root)}: {n} lines" for p in paths
                  if (n := len(p.read_text().splitlines())) > limit)


# ---- the real tree ----------------------------------------------------------------------------------------
def test_every_layer_is_a_package():
    for pkg in LAYERS:
        assert (ROOT / pkg / "__init__.py").is_file(), pkg


def test_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_packages_import_only_downwards():
    assert upward_imports(import_graph(ROOT)) == []


def test_engine_parts_import_only_downwards():
    assert backward_imports(import_graph(ROOT, ("engine",))) == []


def test_no_python_file_over_500_lines():
    assert long_files(ROOT) == []


def test_readme_is_a_door():
    assert (ROOT / "README.md").stat().st_size <= README_MAX_BYTES


# ---- the checks can fail ----------------------------------------------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    root = _tree(tmp_path, {
        "engine/__init__.py": "",
        "engine/a.py": "from engine.b import f\n",
        "engine/b.py": "def f():\n    from engine import a\n",
        "engine/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.d import g\n",
        "engine/d.py": "from engine.c import h\n",
    })
    assert cycles(import_graph(root, ("engine",))) == [["engine.a", "engine.b"]]


def test_a_submodule_importing_its_package_init_is_a_cycle(tmp_path):
    root = _tree(tmp_path, {
        "engine/__init__.py": "from engine.config import Config\n",
        "engine/config.py": "from engine import errors\nfrom engine import Thing\n",
        "engine/errors.py": "",
    })
    graph = import_graph(root, ("engine",))
    assert graph["engine.config"] == {"engine", "engine.errors"}
    assert cycles(graph) == [["engine", "engine.config"]]


@pytest.mark.parametrize("relative", [False, True])
def test_an_upward_import_is_found(tmp_path, relative):
    root = _tree(tmp_path, {
        "engine/__init__.py": "",
        "engine/llm.py": "def f():\n    import pipeline.runner\n",
        "pipeline/__init__.py": "",
        "pipeline/runner.py": "from engine.llm import f\n" + ("from . import job\n" if relative else ""),
        "pipeline/job.py": "",
    })
    graph = import_graph(root, ("engine", "pipeline"))
    assert upward_imports(graph, ("engine", "pipeline")) == ["engine.llm imports pipeline.runner"]
    assert ("pipeline.job" in graph["pipeline.runner"]) == relative


def test_a_backward_import_inside_engine_is_found(tmp_path):
    root = _tree(tmp_path, {
        "engine/__init__.py": "from engine.scheduler import Scheduler\n",
        "engine/errors.py": "",
        "engine/config.py": "from engine.errors import ConfigError\n"
                            "def check():\n    from engine.sample.sampler import draw\n",
        "engine/sample/__init__.py": "",
        "engine/sample/sampler.py": "from engine.sample import rejection\nfrom engine.config import check\n",
        "engine/sample/rejection.py": "from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from engine.scheduler import Scheduler\n",
        "engine/scheduler.py": "import engine.errors\n",
        "engine/extra.py": "",
    })
    order = ("errors", "config", "sample", "scheduler", "__init__")
    assert backward_imports(import_graph(root, ("engine",)), order) == [
        "engine.config imports engine.sample.sampler",
        "engine.extra: its part 'extra' has no rank",
    ]


def test_a_long_file_is_found(tmp_path):
    root = _tree(tmp_path, {"engine/big.py": "x = 1\n" * 501, "engine/ok.py": "x = 1\n" * 500})
    assert long_files(root) == ["engine/big.py: 501 lines"]
