"""The package's layers, read from its source: the core imports nothing from the trainer,
the config or the start-up layer; no module imports another package's private names; and
no two of the package's modules import each other, directly or through others."""

import ast
import os

import jaxrl_llm

ROOT = os.path.dirname(jaxrl_llm.__file__)
CORE = ("models", "sampling", "rl", "envs", "verifiers", "data", "parallel")
ABOVE_CORE = ("jaxrl_llm.trainer", "jaxrl_llm.startup", "jaxrl_llm.config", "jaxrl_llm.train")


def _modules() -> dict[str, str]:
    """module name -> path, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(ROOT))
                module = rel[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
                found[module] = os.path.join(folder, name)
    return found


def _imports(path: str, modules) -> set[str]:
    """The package's modules that `path` imports, at any depth of its code (a function's
    imports count: they run too; those under `if TYPE_CHECKING:` do not)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def test_the_core_imports_nothing_from_the_layers_above():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        if module.split(".")[1:2] and module.split(".")[1] in CORE:
            for imported in _imports(path, modules):
                if imported.startswith(ABOVE_CORE):
                    wrong.append(f"{module} imports {imported}")
    assert not wrong, wrong


def test_no_private_names_of_other_packages():
    hits = []
    for module, path in _modules().items():
        text = open(path, encoding="utf-8").read()
        for word in ("jax._src", "compiled._params", "_device_assignment"):
            if word in text:
                hits.append(f"{module}: {word}")
    assert not hits, hits


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    # A package's __init__ re-exports its modules: an edge to the package stands for them.
    state, cycle = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if node.startswith(nxt + ".") or nxt.startswith(node + "."):
                continue  # a package and its own modules
            if state.get(nxt) == "open":
                cycle.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycle, cycle[:5]
