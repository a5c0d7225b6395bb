"""Import each named project module on its own, as a fresh interpreter would, without starting one per module.

Run as ``python -c "$(cat import_probe.py)" MODULE...`` from the repository root (so ``sys.path[0]`` is ``''`` as for
``python -c "import MODULE"``); prints one JSON object: module -> {"error", "networking"}. The project is the set of
top-level packages of the modules named.

Why not one interpreter per module: ~150 interpreters each loading numpy, gguf, cryptography... took ~220 s on two
cores, almost all of it third-party imports that no test here is about. Instead this process imports the top-level
packages of the third-party libraries the project uses (never a project module, never a networking package), then
forks one child per module. A child starts with no project module loaded, so it checks what the fresh interpreter
checked: the module's own imports suffice (nothing it needs was left by another project module), no cycle breaks
it when imported first, and it leaves no non-daemon thread that would hang the interpreter's exit. It also reports
which networking packages (aiohttp, aioquic, libp2p) its import loaded: the parent loaded none, so that set is exact.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import traceback

NETWORKING = ("aiohttp", "aioquic", "libp2p")
TIMEOUT_S = 120  # per module, as the interpreter-per-module test allowed
PARALLEL = 2  # children at once: the machine this runs on has two cores


def _top(name: str) -> str:
    return name.partition(".")[0]


def _child(name: str, out: int) -> None:
    """In a forked child: import *name*, write what happened to the pipe *out*, and leave without cleanup."""
    signal.alarm(TIMEOUT_S)
    try:
        importlib.import_module(name)
        error = ""
    except BaseException as exc:  # noqa: B036 - a SystemExit or KeyboardInterrupt at import is a failure to report too
        error = traceback.format_exception_only(exc)[-1].strip()
    lingering = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not error and lingering:
        error = f"left non-daemon threads running (a fresh interpreter would wait on them at exit): {lingering}"
    report = {"error": error, "networking": [m for m in NETWORKING if m in sys.modules]}
    os.write(out, json.dumps(report).encode())
    os._exit(0)


def _fork(name: str, task) -> tuple[int, int]:
    """Start a child running ``task(name, write_end)``; returns its pid and the pipe's read end."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # a module printing on import must not corrupt the parent's JSON
        os.dup2(devnull, 2)
        task(name, write)
    os.close(write)
    return pid, read


def _collect(pid: int, read: int) -> tuple[bytes, int]:
    """Read a child's whole report, then reap it; returns the bytes and its wait status."""
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    return b"".join(chunks), os.waitpid(pid, 0)[1]


def _third_party_tops(task_names: list[str]) -> list[str]:
    """The top-level packages outside the project that importing every module loads (found in a throwaway child,
    so this process never runs project code)."""

    def every(_: str, out: int) -> None:
        for name in task_names:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: B036 - the per-module children report it; here only the library list matters
                pass
        os.write(out, json.dumps(sorted({_top(m) for m in sys.modules})).encode())
        os._exit(0)

    data, _ = _collect(*_fork("", every))
    project = {_top(n) for n in task_names} | {"tests"}
    return [t for t in json.loads(data) if t not in project and t not in NETWORKING and not t.startswith("_")]


def _preload(tops: list[str]) -> None:
    """Import the libraries' top-level packages here, once, for every child (not their submodules: a module that
    uses one without importing it fails in its child as in a fresh interpreter, unless the package's own
    ``__init__`` imports it, which a fresh interpreter would run too)."""
    for top in tops:
        if top in sys.modules:
            continue
        try:
            importlib.import_module(top)
        except Exception:  # e.g. a name only a submodule import defines: the children load it themselves
            continue
    loaded = [m for m in NETWORKING if m in sys.modules]
    if loaded:
        raise SystemExit(f"preloading third-party packages loaded networking {loaded}: the networking report would be wrong")


def main(names: list[str]) -> None:
    _preload(_third_party_tops(names))
    results: dict[str, dict] = {}
    running: dict[int, tuple[str, int]] = {}
    pending = list(names)
    while pending or running:
        while pending and len(running) < PARALLEL:
            name = pending.pop(0)
            pid, read = _fork(name, _child)
            running[pid] = (name, read)
        pid = next(iter(running))
        name, read = running.pop(pid)
        data, status = _collect(pid, read)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
            results[name] = {"error": f"import did not finish within {TIMEOUT_S} s", "networking": []}
        elif not data:
            results[name] = {"error": f"the import child died (wait status {status})", "networking": []}
        else:
            results[name] = json.loads(data)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
