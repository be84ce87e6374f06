"""The house's shape: no import circle inside rl_triton, the engine below the ops, one input
order per op shared by its public function, its custom op and its kernel slots."""
import ast
import inspect
import pathlib
import typing

import pytest
import torch

import rl_triton
from rl_triton._core.op import OPS, ops

ROOT = pathlib.Path(rl_triton.__file__).parent


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports():
    """Module -> the rl_triton modules it imports at module level (lazy imports inside
    functions do not make a circle at import time, but are counted too: they are edges)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        if "integrations" in path.parts:  # import their frameworks; above everything
            continue
        mod = _module(path)
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for n in names:
                if n.split(".")[0] == "rl_triton" and n != mod:
                    deps.add(n)
        graph[mod] = deps
    modules = set(graph)
    # an imported name that is not a module (a function) counts as its module
    return {m: {d if d in modules else d.rpartition(".")[0] for d in deps} & modules - {m}
            for m, deps in graph.items()}


def test_no_import_circle():
    graph = _imports()
    graph = {m: {d for d in deps if not m.startswith(d + ".") and d != "rl_triton"}
             for m, deps in graph.items()}  # a package's own __init__ is not a step back
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in graph.get(m, ()):
            if state.get(d) == "open":
                pytest.fail("import circle: " + " -> ".join(path + [m, d]))
            if d not in state:
                visit(d, path + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def test_the_engine_is_below_the_ops_and_the_plan_cache():
    for m, deps in _imports().items():
        if m.startswith("rl_triton.scan"):
            bad = {d for d in deps if d.startswith(("rl_triton.ops", "rl_triton._core"))
                   or d == "rl_triton"}
            assert not bad, f"{m} imports {bad}"
        if m.startswith("rl_triton._core"):
            assert not {d for d in deps if d.startswith("rl_triton.ops")}, deps


@pytest.mark.parametrize("name", ops("scan"))
def test_one_input_order(name):
    """The public function's tensor arguments, the custom op's first arguments and the op's
    input NamedTuple (whose positions are the kernel's slots) are in one order."""
    op = OPS[name]
    fields = list(op.inputs._fields)
    params = list(inspect.signature(getattr(rl_triton, name)).parameters)
    assert [p for p in params if p in fields] == fields
    schema = op.custom_op._opoverload._schema
    assert [a.name for a in schema.arguments][:len(fields)] == fields
    hints = typing.get_type_hints(op.inputs)
    assert all(h in (torch.Tensor, typing.Optional[torch.Tensor]) for h in hints.values())
    assert getattr(torch.ops.rl_triton, name) is not None
