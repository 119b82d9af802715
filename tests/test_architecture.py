"""The import graph of src/: no cycles, and lower layers never import higher ones.

Every module of ``credit_parallel`` is parsed with ``ast`` (nothing is imported), counting
function-local imports too: a cycle hidden inside a function is still a cycle.  The layers,
lowest first, are the packages (docs/architecture.md draws them):

    models        the networks; they know nothing of parallelism beyond their declarations
    layout        layout/: ParallelDims, RankLayout, mesh, device, launch, run config, compat
    domain        domain/: domain parallelism
    parallel      parallel/: tensor parallel, FSDP2/DDP, gradient collectives, compile, parallelize
    data          data/: the dataset read by rows, the loader
    planner       planner/: plan (layout planner and cost model, without processes)
    training      train/: preflight, model build, the step, the trainer, checkpoints;
                  forecast/: rollouts, the forecast store, exact scores (the trainer's
                  evaluate uses them), the forecast command
    testing       testing.py: the multi-rank test harness
    tools         tools/: verify, benchmarks, profiler, launcher, forensics, mesh demo
    cli           the command line

A module may import modules of its own layer or lower ones.  A module gets its layer from its
package; a new top-level module or package must be given one in ``LAYER_OF`` below.
"""

from __future__ import annotations

import ast
import pathlib

import credit_parallel

__all__: list[str] = []

PKG = "credit_parallel"
LAYERS = (
    "models",
    "layout",
    "domain",
    "parallel",
    "data",
    "planner",
    "training",
    "testing",
    "tools",
    "cli",
)
# module or package prefix -> layer (the longest matching prefix wins)
LAYER_OF = {
    "models": "models",
    "lazy": "layout",
    "layout": "layout",
    "domain": "domain",
    "parallel": "parallel",
    "data": "data",
    "planner": "planner",
    "train": "training",
    "forecast": "training",
    "testing": "testing",
    "tools": "tools",
    "cli": "cli",
}
#: at most this many modules directly under src/credit_parallel (issue 24)
MAX_TOP_LEVEL_MODULES = 8


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PKG, *parts])


def _imported(module: str, is_package: bool, node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """{module: modules of the package it imports}, function-local imports included.  An import
    of a module's own ancestor package (``from . import x`` inside it) is not an edge: Python
    resolves it without re-entering the importing module."""
    root = pathlib.Path(credit_parallel.__file__).parent
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(module, is_package, node):
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if (
                    target.startswith(PKG + ".")
                    and target != module
                    and not module.startswith(target + ".")
                ):
                    graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def layer(module: str) -> str | None:
    """The layer of ``credit_parallel.<module>`` by its longest prefix in LAYER_OF."""
    name = module[len(PKG) + 1 :]
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYER_OF:
            return LAYER_OF[prefix]
    return None


def test_the_graph_sees_function_local_imports():
    graph = import_graph()
    # cli imports the benchmark only inside its command functions
    assert f"{PKG}.tools.bench" in graph[f"{PKG}.cli"]
    assert f"{PKG}.train.step" in graph[f"{PKG}.train.trainer"]


def test_a_cycle_is_detected_by_the_check():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_src():
    assert _cycles(import_graph()) == []


def test_every_module_has_a_layer():
    unassigned = sorted(m for m in import_graph() if m != PKG and layer(m) is None)
    assert not unassigned, f"give these modules a layer in LAYER_OF: {unassigned}"


def test_lower_layers_never_import_higher_ones():
    rank = {name: i for i, name in enumerate(LAYERS)}
    graph = import_graph()
    upward = []
    for module, targets in graph.items():
        if module == PKG:
            continue  # the top-level package re-exports the public names of every layer
        for target in sorted(targets):
            if rank[layer(target)] > rank[layer(module)]:
                upward.append(f"{module} ({layer(module)}) imports {target} ({layer(target)})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_top_level_holds_only_packages_and_faces():
    root = pathlib.Path(credit_parallel.__file__).parent
    modules = sorted(p.name for p in root.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules
    packages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    unlayered = [p for p in packages if p not in LAYER_OF]
    assert not unlayered, f"give these packages a layer in LAYER_OF: {unlayered}"


def test_every_package_face_says_what_goes_there():
    """The newcomer's test: each package opens with a docstring of a few lines at least."""
    root = pathlib.Path(credit_parallel.__file__).parent
    for init in sorted(root.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.splitlines()) >= 3, f"{init.parent.name}/__init__.py: say what goes there"


def test_models_and_domain_never_reach_training_tools_or_the_command_line():
    graph = import_graph()
    forbidden = ("parallel", "data", "train", "forecast", "tools", "cli", "planner", "testing")
    bad = [
        f"{m} imports {t}"
        for m, targets in graph.items()
        if m.startswith((f"{PKG}.models", f"{PKG}.domain"))
        for t in targets
        if t[len(PKG) + 1 :].split(".")[0] in forbidden
    ]
    assert not bad, "\n".join(bad)
    models = [
        f"{m} imports {t}"
        for m, targets in graph.items()
        if m.startswith(f"{PKG}.models")
        for t in targets
        if not t.startswith(f"{PKG}.models")
    ]
    assert not models, "models know nothing of parallelism:\n" + "\n".join(models)
