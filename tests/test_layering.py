"""The tree's shape, held: packages import only downwards (engine <- costmodel <- pipeline <- bench <- batchgen),
no two modules import each other (directly or round a longer loop, imports inside functions included, those under
``if TYPE_CHECKING:`` aside), inside engine/ and pipeline/ their parts import only downwards too (``ENGINE_ORDER``,
``PIPELINE_STAGES``; pipeline/ counts ``TYPE_CHECKING`` imports as well), no Python file over 500 lines, no function
over 80 lines (those in ``LONG_FUNCTION_EXCEPTIONS`` aside: a list that may only shrink), and a README that stays a
door (<= 15,000 bytes).

Each rule is checked on the real tree and, so the check itself can fail, on a small tree that breaks it.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Lower rank first: a module may import its own package and packages of lower rank only.
LAYERS = ("engine", "costmodel", "pipeline", "bench", "batchgen")
# pipeline/'s stages in the order data flows (docs/design/layout.md); a stage imports only itself and earlier ones.
PIPELINE_STAGES = ("problems", "io", "job", "plan", "prepare", "execute", "assemble", "schedule", "run", "report",
                   "serve", "__init__")
MAX_LINES = 500
# engine/'s parts (a top-level module, or a subpackage with all its modules), lowest first: a part imports only
# itself and parts listed before it. "__init__" is the package's own door (engine/__init__.py).
ENGINE_ORDER = (
    "errors", "cache_root", "outputs", "scheduler_output", "omp_wait", "malloc", "huge_pages",  # no engine deps
    "kernels", "dtype_policy", "invariance",                                              # the machine
    "config", "structured", "sampling_params", "request", "detokenizer", "interface",     # what is asked
    "block_pool", "kv_cache_manager", "scheduler",                                        # who computes what
    "quant", "attention", "models", "loader", "tokenizer", "memory",                      # the model
    "sample", "spec_decode", "model_runner",                                              # one step's compute
    "tuning", "setup", "llm", "__init__",                                                 # start-up, the door
)
README_MAX_BYTES = 15_000
MAX_FUNCTION_LINES = 80
# "path:function" allowed over MAX_FUNCTION_LINES. Empty, and it stays so: nothing may be added (an entry that is not
# over the limit fails the test until it is removed).
LONG_FUNCTION_EXCEPTIONS: frozenset[str] = frozenset()


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
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def import_graph(root: Path, packages=LAYERS, type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (anywhere in the file: function bodies too; those under
    ``if TYPE_CHECKING:`` only with ``type_checking``).

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``."""
    mods = _modules(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if type_checking else _type_checking_nodes(tree)
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


def unnamed_modules(root: Path, packages=LAYERS, doc: str = "docs/design/layout.md") -> list[str]:
    """Modules of ``packages`` whose file name (``runner.py``) the layout document does not mention."""
    text = (root / doc).read_text()
    return [p.relative_to(root).as_posix() for pkg in packages for p in sorted((root / pkg).rglob("*.py"))
            if p.name != "__init__.py" and not re.search(rf"(?<![\w]){re.escape(p.name)}", text)]


def long_files(root: Path, limit: int = MAX_LINES) -> list[str]:
    paths = [p for d in (*LAYERS, "tests", "sample_data") for p in (root / d).rglob("*.py")]
    return sorted(f"{p.relative_to(root)}: {n} lines" for p in paths
                  if (n := len(p.read_text().splitlines())) > limit)


def long_functions(root: Path, packages=LAYERS, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """"path:function" -> lines (``end_lineno - lineno + 1``) of every function or method of ``packages`` over
    ``limit`` lines, nested ones too."""
    found = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if (n := node.end_lineno - node.lineno + 1) > limit:
                        found[f"{path.relative_to(root).as_posix()}:{node.name}"] = n
    return found


def long_function_problems(root: Path, exceptions=LONG_FUNCTION_EXCEPTIONS, packages=LAYERS,
                           limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions over ``limit`` lines not in ``exceptions``, and exceptions no longer over it (to remove)."""
    found = long_functions(root, packages, limit)
    return sorted([f"{name}: {n} lines, over {limit}" for name, n in found.items() if name not in exceptions]
                  + [f"{name}: not over {limit} lines any more; remove it from LONG_FUNCTION_EXCEPTIONS"
                     for name in exceptions if name not in found])


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


def test_pipeline_has_no_circles_even_for_type_checking():
    graph = import_graph(ROOT, type_checking=True)
    assert [c for c in cycles(graph) if c[0].startswith("pipeline")] == []


def test_pipeline_stages_import_only_earlier_stages():
    graph = import_graph(ROOT, ("pipeline",), type_checking=True)
    assert backward_imports(graph, PIPELINE_STAGES, "pipeline") == []


def test_no_python_file_over_500_lines():
    assert long_files(ROOT) == []


def test_no_function_over_80_lines_and_the_exceptions_only_shrink():
    assert long_function_problems(ROOT) == []


def test_every_module_is_named_in_the_layout_document():
    assert unnamed_modules(ROOT) == []


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


def test_a_back_arrow_between_pipeline_stages_is_found_type_checking_too(tmp_path):
    root = _tree(tmp_path, {
        "pipeline/io/tables.py": ("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from pipeline.run.runner import R\n"),
        "pipeline/run/runner.py": "from pipeline.io.tables import read\n",
        "pipeline/problems.py": "",
    })
    stages = ("problems", "io", "run")
    assert backward_imports(import_graph(root, ("pipeline",)), stages, "pipeline") == []
    assert backward_imports(import_graph(root, ("pipeline",), type_checking=True), stages, "pipeline") == [
        "pipeline.io.tables imports pipeline.run.runner"]


def test_an_unnamed_module_is_found(tmp_path):
    root = _tree(tmp_path, {"engine/llm.py": "", "engine/sample/sampler.py": "", "engine/sample/__init__.py": "",
                            "docs/design/layout.md": "llm.py the door; sample/ (sampler, the draw)"})
    assert unnamed_modules(root, ("engine",)) == ["engine/sample/sampler.py"]


def test_a_long_file_is_found(tmp_path):
    root = _tree(tmp_path, {"engine/big.py": "x = 1\n" * 501, "engine/ok.py": "x = 1\n" * 500})
    assert long_files(root) == ["engine/big.py: 501 lines"]


def test_a_long_function_is_found_and_a_stale_exception_too(tmp_path):
    body = "    x = 1\n"
    root = _tree(tmp_path, {
        "engine/__init__.py": "",
        "engine/big.py": ("def long():\n" + body * 80                              # 81 lines
                          + "class C:\n    def ok(self):\n" + ("    " + body) * 79   # 80 lines: not over
                          + "    async def nested_host(self):\n        async def inner():\n"
                          + ("    " * 2 + body) * 80),                                # inner 81, host 82
        "engine/listed.py": "def still_long():\n" + body * 90,
        "engine/fixed.py": "def short_now():\n" + body * 5,
    })
    assert long_functions(root, ("engine",)) == {"engine/big.py:long": 81, "engine/big.py:nested_host": 82,
                                                 "engine/big.py:inner": 81, "engine/listed.py:still_long": 91}
    assert long_function_problems(root, {"engine/listed.py:still_long", "engine/fixed.py:short_now"},
                                  ("engine",)) == [
        "engine/big.py:inner: 81 lines, over 80",
        "engine/big.py:long: 81 lines, over 80",
        "engine/big.py:nested_host: 82 lines, over 80",
        "engine/fixed.py:short_now: not over 80 lines any more; remove it from LONG_FUNCTION_EXCEPTIONS"]
