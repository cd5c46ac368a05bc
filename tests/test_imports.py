"""The package's import structure: every module imports on its own in a fresh interpreter, and the
graph of module-level imports between interlace's modules has no cycle."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import interlace

ROOT = Path(interlace.__file__).parent


def _modules() -> list[str]:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _path(module: str) -> Path:
    base = ROOT.parent.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _imported(module: str, known: set[str]) -> set[str]:
    """interlace modules that `module` imports anywhere, inside functions too (an import moved
    into a function still closes a cycle), except under `if TYPE_CHECKING:` and under
    `if __name__ == "__main__":`; `from package import name` counts the submodule when `name` is
    one, and the packages holding an imported module count too (importing a.b.c runs
    a/__init__ and a/b/__init__ first)."""
    tree = ast.parse(_path(module).read_text())
    package = module if _path(module).name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in known and prefix != module and not module.startswith(prefix + "."):
                    found.add(prefix)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` outside `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            continue  # runs as a script only, never on import
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _runtime_nodes_of(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def _runtime_nodes_of(node: ast.AST):
    yield node
    yield from _runtime_nodes(node)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_module_imports_have_no_cycle():
    known = set(_modules())
    graph = {m: _imported(m, known) for m in known}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


_IMPORT_EACH = """
import importlib, os, sys, traceback
# the libraries it uses load once, here; each interlace module then imports in its own child,
# as many children at a time as there are cores
libraries, modules = sys.argv[1].split(","), sys.argv[2:]
for lib in libraries:
    try:
        importlib.import_module(lib)
    except Exception:
        pass
running, failed = {}, []
def reap():
    pid, status = os.wait()
    if status != 0:
        failed.append(running[pid])
    del running[pid]
for name in modules:
    if len(running) >= (os.cpu_count() or 1):
        reap()
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    running[pid] = name
while running:
    reap()
print("FAILED:" + ",".join(sorted(failed)))
# the command line's parser, built in a child too: which benchmark modules did it load?
read, write = os.pipe()
if os.fork() == 0:
    from interlace.cli import build_parser
    build_parser()
    loaded = sorted(m for m in sys.modules if m.startswith("interlace.bench"))
    os.write(write, ("CLI_LOADS:" + ",".join(loaded)).encode())
    os._exit(0)
os.close(write)
os.wait()
print(os.read(read, 1 << 16).decode())
"""

PEERS = {"interlace.bench.tp_megatron": "megatron", "interlace.bench.moe_deepspeed": "deepspeed"}
"""Benchmark modules that import a peer project, installed only with the `peers` extra."""


def _libraries(module: str) -> set[str]:
    """The modules outside interlace that `module` imports at its top level."""
    tree = ast.parse(_path(module).read_text())
    names = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and not n.level}
    return {n for n in names if n and n.split(".")[0] not in ("interlace", "__future__")}


@pytest.fixture(scope="module")
def fresh_imports() -> subprocess.CompletedProcess:
    """One run of `_IMPORT_EACH` over every module (those needing an absent peer left out)."""
    modules = [
        m for m in _modules() if m not in PEERS or importlib.util.find_spec(PEERS[m]) is not None
    ]
    libraries = sorted(set().union(*(_libraries(m) for m in modules)))
    return subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, ",".join(libraries), *modules],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_module_imports_alone(fresh_imports):
    """Each module imports first, in a fresh child of an interpreter that has loaded the
    libraries they use and no interlace module (an import that works only after another
    interlace module's fails here)."""
    failed = fresh_imports.stdout.partition("FAILED:")[2].splitlines()[0].strip()
    assert fresh_imports.returncode == 0 and not failed, f"{failed}\n{fresh_imports.stderr[-3000:]}"


def test_the_command_line_loads_no_benchmark_code(fresh_imports):
    """Building `interlace`'s parser imports no module of interlace.bench (they load only when
    `interlace bench` runs)."""
    assert fresh_imports.returncode == 0, fresh_imports.stderr[-3000:]
    assert fresh_imports.stdout.rpartition("CLI_LOADS:")[2].strip() == ""
