"""The package's shape: no import cycles between its modules (function-level imports counted too), and
no module named after a standard-library module (``import inspect`` inside the package must mean the
standard library's)."""
import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gluon_attn"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body."""
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module
                # "from . import x" names a module; "from .m import f" names m.
                targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in mods else name for a in node.names]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                # A module importing its own package (or itself) is not an edge between two modules.
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path, or [] (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return []

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a"}}) == []


def test_the_import_graph_sees_relative_and_function_level_imports():
    graph = _import_graph(_modules())
    assert "gluon_attn.bench.providers" in graph["gluon_attn.bench.sweep"]
    assert "gluon_attn.api" in graph["gluon_attn.bench.gluon_providers"]  # imported inside a function


def test_no_import_cycles():
    cycle = _cycle(_import_graph(_modules()))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


@pytest.mark.skipif(not hasattr(sys, "stdlib_module_names"), reason="needs Python 3.10+")
def test_no_module_is_named_after_a_stdlib_module():
    clashes = sorted(m for m in _modules() if m.rpartition(".")[2] in sys.stdlib_module_names)
    assert not clashes, f"modules named after standard-library modules: {clashes}"


def test_only_the_backend_interface_reaches_the_kernel_modules():
    """api, providers, inspect, configs and optimize dispatch through kernels.backend: nothing outside
    gluon_attn/kernels imports an arch's kernel module."""
    graph = _import_graph(_modules())
    arch_modules = {"gluon_attn.kernels.hopper", "gluon_attn.kernels.blackwell", "gluon_attn.kernels.hopper_host",
                    "gluon_attn.kernels.blackwell_host"}
    outside = {m: sorted(graph[m] & arch_modules) for m in graph
               if not m.startswith("gluon_attn.kernels") and graph[m] & arch_modules}
    assert not outside, outside


def test_every_backend_provides_the_interface():
    from gluon_attn.kernels.backend import BACKENDS, backend_for_arch, backend_for_capability

    for arch, backend in BACKENDS.items():
        mod = backend.module
        for name in ("CONFIG", "HEAD_DIMS", "DTYPES", "default_config", "packed_config", "config_space",
                     "in_focused_space", "launch", "build"):
            assert hasattr(mod, name), (arch, name)
        cfg = backend.default_config(128, "fp16", True)
        assert isinstance(cfg, backend.config_type) and cfg.invalid_reasons(128, "fp16") == []
        assert set(cfg.describe()) >= {"config", "block_m", "block_n", "stages"}
        assert backend_for_arch(arch) is backend and backend_for_capability(backend.major) is backend
    # attention() validates dtypes with one backend's list: they must agree (head dims differ: 256 on sm_90a
    # only; attention() checks them against the union, then the GPU's backend)
    assert len({b.dtypes for b in BACKENDS.values()}) == 1
    assert BACKENDS["sm_90a"].head_dims == (32, 64, 96, 128, 192, 256)
    assert BACKENDS["sm_100a"].head_dims == (32, 64, 96, 128)
    assert BACKENDS["sm_90a"].module.KERNEL_HEAD_DIMS == (64, 128, 256)  # (32, 96 and 192 run padded)
    assert BACKENDS["sm_100a"].module.KERNEL_HEAD_DIMS == (64, 128)
    assert backend_for_capability(8, 0) is None
    with pytest.raises(ValueError, match="available: sm_90a, sm_100a"):
        backend_for_arch("sm_80")



def _private_imports(source: str, name: str) -> list[str]:
    """``from .m import _x`` lines of a module's source (a private name of another package module)."""
    return [f"{name}: from .{node.module} import {a.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.level for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")]


def test_no_kernel_module_imports_another_modules_private_names():
    """A name one kernel module shares with another is public: ``from .hopper import _walk_box`` in blackwell.py
    tied two kernels to a private helper of one (renaming with ``as _name`` on the importing side is fine)."""
    found = [line for path in sorted((PACKAGE / "kernels").glob("*.py"))
             for line in _private_imports(path.read_text(), path.name)]
    assert not found, found


def test_the_private_import_check_sees_one():
    source = "from .hopper import (public, _private as mine, __version__)\nfrom triton.language.core import _aggregate"
    assert _private_imports(source, "x.py") == ["x.py: from .hopper import _private"]


def _assign_only_inits(source: str, name: str) -> list[str]:
    """Gluon aggregates whose ``__init__`` only stores its arguments in the fields' order (what ``gluon.aggregate``
    generates), and imports of Triton's private ``_aggregate``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and any(a.name == "_aggregate" for a in node.names):
            found.append(f"{name}: imports _aggregate")
        if not (isinstance(node, ast.ClassDef) and any(ast.unparse(d).endswith("aggregate") for d in node.decorator_list)):
            continue
        fields = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        for init in (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"):
            body = [s for s in init.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            stores = [(ast.unparse(s.targets[0]), ast.unparse(s.value)) for s in body
                      if isinstance(s, ast.Assign) and len(s.targets) == 1]
            params = [a.arg for a in init.args.args[1:]]
            if params == fields and not init.args.defaults and len(stores) == len(body) == len(fields) and all(
                    t == f"self.{f}" and v in (f, f"gl.constexpr({f})") for (t, v), f in zip(stores, fields)):
                found.append(f"{name}: {node.name}.__init__ only stores its arguments")
    return found


def test_kernel_aggregates_use_gluons_public_aggregate_and_its_generated_init():
    found = [line for path in sorted((PACKAGE / "kernels").glob("*.py"))
             for line in _assign_only_inits(path.read_text(), path.name)]
    assert not found, found


def test_the_assign_only_check_sees_one():
    source = '''
from triton.language.core import _aggregate as aggregate
@aggregate
class A:
    x: gl.tensor
    N: gl.constexpr
    def __init__(self, x, N):
        self.x = x
        self.N = gl.constexpr(N)
@aggregate
class B:
    x: gl.tensor
    def __init__(self, x):
        self.x = x * 2
'''
    assert _assign_only_inits(source, "k.py") == ["k.py: imports _aggregate", "k.py: A.__init__ only stores its arguments"]
