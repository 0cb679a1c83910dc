"""The package's layers as docs/README.md's Layout section lists them, against the imports
the code makes: every module is listed there (its folder, or its file), and each imports
only from its own layer or from the layers listed above it (lazy imports inside functions
and type-checking ones count too)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _layers() -> list:
    """The Layout block's layers, in order: [(heading, {top-level names under it})]; a
    heading is a line indented 4 spaces that names no path, a member a line indented 4
    spaces that starts with jaxrl_llm/<name>."""
    text = (ROOT / "docs" / "README.md").read_text()
    block = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in block.splitlines():
        if re.match(r"^    [a-z][a-z ]*$", line):
            layers.append((line.strip(), set()))
        elif m := re.match(r"^    jaxrl_llm/(\w+)", line):
            layers[-1][1].add(m.group(1))
    return layers


def _imports() -> dict:
    """Each top-level name of the package (a folder, or a module file) -> {(top-level name
    it imports, file:line)}."""
    out: dict = {}
    for path in sorted((ROOT / "jaxrl_llm").rglob("*.py")):
        rel = path.relative_to(ROOT / "jaxrl_llm")
        if rel.parts == ("__init__.py",):
            continue
        top = rel.parts[0].removesuffix(".py")
        got = out.setdefault(top, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "jaxrl_llm":
                    names = [f"jaxrl_llm.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "jaxrl_llm" and len(parts) > 1 and parts[1] != top:
                    got.add((parts[1], f"{rel}:{node.lineno}"))
    return out


def test_the_docs_layout_lists_every_module_and_imports_go_up_the_layers_only():
    layers = _layers()
    assert [h for h, _ in layers] == ["core", "config", "rollout wing", "trainer", "command lines"]
    layer_of = {name: i for i, (_, names) in enumerate(layers) for name in names}
    imports = _imports()
    unlisted = sorted(set(imports) - set(layer_of))
    assert not unlisted, f"not in docs/README.md's Layout: {unlisted}"
    wrong = [
        f"{where} ({layers[layer_of[top]][0]}) imports {name} ({layers[layer_of[name]][0]})"
        for top, got in imports.items()
        for name, where in sorted(got)
        if layer_of[name] > layer_of[top]
    ]
    assert not wrong, "\n".join(wrong)
