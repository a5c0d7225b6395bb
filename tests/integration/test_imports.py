"""The package layout holds: every module imports on its own, the import graph has no cycle, and cheap commands
stay cheap (the CLI imports a command family only when it runs)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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


PROBE = ROOT / "tests" / "support" / "import_probe.py"


def probe(names: list[str], cwd: Path = ROOT) -> dict[str, dict]:
    """Each module imported on its own by :mod:`tests.support.import_probe` (one forked child per module, no
    project module loaded before it): module -> {"error": last line or "", "networking": packages it loaded}."""
    proc = subprocess.run([sys.executable, "-c", PROBE.read_text(), *names], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def alone() -> dict[str, dict]:
    """Every module of node/, p2p/, relay/ and experts/, each imported alone (one probe run for the tests below)."""
    names = sorted(set(all_modules()) - ENTRY_POINTS)
    report = probe(names)
    assert sorted(report) == names
    return report


PLANTED = {
    "__init__.py": "",
    "base.py": "X = 1\n",
    "leaner.py": "import lay\n\nY = lay.base.X  # works only if another module imported lay.base first\n",
    "cyc_a.py": "import lay.cyc_b\n\nA = 1\n",  # imported first, cyc_b's `from lay.cyc_a import A` finds no A yet
    "cyc_b.py": "from lay.cyc_a import A\n",
    "net.py": "import aioquic\n",
    "printer.py": "print('{not json')\n",
    "thread.py": "import threading, time\n\nthreading.Thread(target=time.sleep, args=(30,)).start()\n",
    "fine.py": "import numpy\nimport lay.base\n",
}


def test_the_probe_reports_what_a_fresh_interpreter_would(tmp_path):
    """Planted modules: one that leans on a sibling another module imported, the half of a cycle that breaks when
    imported first, one that starts a thread its interpreter would wait on; all reported, with the networking a
    module loads. The sibling and the cycle's other half pass only when imported alone, so in-turn imports would miss them."""
    (tmp_path / "lay").mkdir()
    for name, text in PLANTED.items():
        (tmp_path / "lay" / name).write_text(text)
    names = sorted(f"lay.{n.removesuffix('.py')}" for n in PLANTED if n != "__init__.py") + ["lay"]
    report = probe(names, cwd=tmp_path)
    errors = {n: r["error"] for n, r in report.items() if r["error"]}
    assert set(errors) == {"lay.leaner", "lay.cyc_a", "lay.thread"}, errors
    assert "has no attribute 'base'" in errors["lay.leaner"]
    assert "partially initialized module 'lay.cyc_a'" in errors["lay.cyc_a"]
    assert "non-daemon threads" in errors["lay.thread"]
    assert report["lay.net"]["networking"] == ["aioquic"]
    assert all(r["networking"] == [] for n, r in report.items() if n != "lay.net")


@pytest.mark.slow
def test_every_module_imports_on_its_own(alone):
    """`import X` succeeds with no other project module loaded before it, for every module of node/, p2p/, relay/
    and experts/ (what `python -c "import X"` checked, in forked children of one interpreter)."""
    failed = [(n, r["error"]) for n, r in alone.items() if r["error"]]
    assert not failed, failed


@pytest.mark.slow
def test_experts_modules_load_no_networking(alone):
    """No module of experts/ loads aiohttp, aioquic or libp2p (docs/architecture.md: experts/ imports nothing from
    networking); modules that do load it exist, so the report is not vacuous."""
    assert {n: r["networking"] for n, r in alone.items() if n.split(".")[0] == "experts" and r["networking"]} == {}
    assert alone["p2p.quic.endpoint"]["networking"] == ["aioquic"] and "aiohttp" in alone["node.gateway.server"]["networking"]


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


def imported_modules(path: Path) -> set[str]:
    """Every module *path* names in an import statement, at any depth (lazy imports inside functions count too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


# Rooms that never import each other (docs/architecture.md): what both need lives in a module below both.
APART = (("node.worker", "node.backbone"),)


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(("a", "b"), APART)
def test_rooms_that_stay_apart_never_import_each_other(a, b):
    modules = all_modules()
    crossings = sorted(
        f"{name} imports {target}"
        for name, path in modules.items()
        for target in imported_modules(path)
        for src, dst in ((a, b), (b, a))
        if _inside(name, src) and _inside(target, dst)
    )
    assert sum(_inside(n, a) for n in modules) > 3 and sum(_inside(n, b) for n in modules) > 3  # both rooms were seen
    assert not crossings, crossings


def test_the_rooms_rule_sees_a_lazy_crossing(tmp_path):
    """The check is not vacuous: an import inside a function counts."""
    planted = tmp_path / "m.py"
    planted.write_text("def f():\n    from node.backbone.routing import Router\n")
    assert "node.backbone.routing" in imported_modules(planted)
