"""The package layout holds: every module imports on its own, the import graph has no cycle, and cheap commands
stay cheap (the CLI imports a command family only when it runs)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("node", "p2p", "relay", "experts")
ENTRY_POINTS = {"node.__main__"}  # runs the CLI when imported: `python -m node`


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def import_edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules *name* imports at module level (imports inside functions are lazy by design)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        edges.update(t for t in targets if t in modules and t != name)
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of *graph* as a path [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    colour = dict.fromkeys(graph, 0)
    for start in graph:
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
            elif colour[child] == 1:
                path = [n for n, _ in stack]
                return path[path.index(child) :] + [child]
            elif colour[child] == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_find_cycle_finds_a_planted_cycle():
    """The cycle finder is not vacuous: a -> b -> c -> a is reported, a DAG is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_module_import_graph_has_no_cycle():
    """No module reaches itself through module-level imports (a cycle breaks importing one of them first)."""
    modules = all_modules()
    graph = {name: import_edges(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the walk saw the real tree
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def _import_alone(name: str) -> tuple[str, int, str]:
    proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    last_line = (proc.stderr.strip().splitlines() or [""])[-1]
    return name, proc.returncode, last_line


@pytest.mark.slow
def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    """`python -c "import X"` succeeds for every module of node/, p2p/, relay/ and experts/."""
    names = sorted(set(all_modules()) - ENTRY_POINTS)
    with ThreadPoolExecutor(2) as pool:
        failed = [(n, err) for n, rc, err in pool.map(_import_alone, names) if rc != 0]
    assert not failed, failed


def test_ledger_show_help_imports_no_networking():
    """`moeswarm ledger show --help` loads neither aiohttp, aioquic nor libp2p (the CLI registers commands lazily)."""
    code = (
        "import json, sys\n"
        "from node.cli import main\n"
        "try:\n    main(['ledger', 'show', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(json.dumps({'heavy': [m for m in ('aiohttp', 'aioquic', 'libp2p') if m in sys.modules], 'ledger': 'node.cli.ledger' in sys.modules}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"heavy": [], "ledger": True}, proc.stdout
