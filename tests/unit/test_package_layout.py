"""The package's layout: subpackages by job, dependencies pointing one way (a module imports its
own subpackage and lower layers only), no import cycle, few modules at the top, and tests that
mirror the subpackages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "chunk_grpo"
# Lowest layer first; the subpackages of one layer do not import each other.
LAYERS = (('config',),
          ('runtime', 'shapes', 'data'),
          ('algorithm', 'models', 'rewards'),
          ('plan', 'evaluate'),
          ('train',),
          ('analysis', 'pretrain'),
          ('cli',))
LAYER = {name: i for i, group in enumerate(LAYERS) for name in group}
TOP = len(LAYERS)  # chunk_grpo/*.py: the package and the `python -m` shims, above cli


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module):
    """Every import statement that runs: at the top or in a function, not under TYPE_CHECKING."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(child) for child in ast.walk(node))
    return [n for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def import_graph() -> dict[str, set[str]]:
    """module -> the chunk_grpo modules it makes Python run (an imported module's packages
    included, unless they already contain the importer)."""
    modules = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif node.level == 0 and node.module:
                wanted = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                          else node.module for a in node.names]
            else:
                raise AssertionError(f"{name}: relative import; use chunk_grpo.<module>")
            for target in wanted:
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # the packages run first
                    prefix = ".".join(parts[:i])
                    if prefix in modules and not name.startswith(prefix + "."):
                        targets.add(prefix)
        targets.discard(name)
        graph[name] = targets
    return graph


def _layer(module: str) -> int:
    """A module's layer; the package, its `python -m` shims and `__main__` files are the top."""
    parts = module.split(".")
    if len(parts) == 1 or parts[-1] == "__main__" or (PACKAGE / f"{parts[1]}.py").is_file():
        return TOP
    return LAYER[parts[1]]


def test_every_subpackage_has_a_layer():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == set(LAYER), "place a new subpackage in LAYERS (or remove a stale one)"


def test_lower_layers_never_import_higher_ones():
    wrong = []
    for module, targets in import_graph().items():
        for target in targets:
            same = module.split(".")[:2] == target.split(".")[:2]
            if not same and target != "chunk_grpo" and _layer(target) >= _layer(module):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_algorithm_needs_no_model_and_no_reward():
    for module, targets in import_graph().items():
        if module.startswith("chunk_grpo.algorithm."):
            assert not {t for t in targets if t.split(".")[1] in ("models", "rewards", "train")}


def test_few_modules_at_the_top_and_each_runs_a_command():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    for path in PACKAGE.glob("*.py"):
        if path.name != "__init__.py":  # a shim: `python -m chunk_grpo.<command>`
            imports = [n for n in ast.parse(path.read_text()).body
                       if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert [ast.unparse(n) for n in imports] == ["from chunk_grpo.cli.main import run"]


def test_the_tests_mirror_the_subpackages():
    unit = {p.name for p in (ROOT / "tests" / "unit").iterdir() if p.is_dir()}
    assert unit - {"__pycache__", "kernels"} <= set(LAYER)  # kernels: grpo_kernels
    assert not list((ROOT / "tests").glob("test_*.py")), "a test belongs in unit/ or integration/"
