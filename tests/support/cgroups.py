"""Memory cgroups for tests that hold a real process to a hard memory limit (cgroup v1 or v2).

A test makes a child of its own memory cgroup (``child_memory_cgroup``), optionally sets a
limit, starts a process inside it through ``MemoryCgroup.prefix`` (a shell that moves itself in,
then execs the command, so nothing is allocated outside) and reads what the kernel charged:
the peak, the current usage, the OOM kills. The child is always removed on exit, after its
processes are killed. Both hierarchies charge file pages (e.g. a memory-mapped model) as well
as anonymous memory; file pages are reclaimable, so a limit pushes them out instead of killing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")

# The same facts under each hierarchy's file names: (limit, peak, current, events file, OOM-kill key).
FILES = {
    1: ("memory.limit_in_bytes", "memory.max_usage_in_bytes", "memory.usage_in_bytes", "memory.oom_control", "oom_kill"),
    2: ("memory.max", "memory.peak", "memory.current", "memory.events", "oom_kill"),
}


class CgroupUnavailable(Exception):
    """No memory cgroup this process may create children in (the message says why): tests skip with it."""


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: int  # 1 or 2

    def _file(self, index: int) -> Path:
        return self.path / FILES[self.version][index]

    def limit(self, n_bytes: int) -> None:
        self._file(0).write_text(str(n_bytes))

    def peak(self) -> int:
        """The most memory (anonymous + page cache + kernel) ever charged to the group, in bytes."""
        return int(self._file(1).read_text())

    def current(self) -> int:
        return int(self._file(2).read_text())

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended for this group's limit."""
        for line in self._file(3).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == FILES[self.version][4]:
                return int(value)
        return 0

    def stat(self) -> dict[str, int]:
        """memory.stat as numbers (v1 ``rss``/``cache``, v2 ``anon``/``file``, ...)."""
        return {k: int(v) for k, v in (line.split() for line in (self.path / "memory.stat").read_text().splitlines())}

    def anon(self) -> int:
        """Anonymous memory charged now (what cannot be reclaimed without swap)."""
        s = self.stat()
        return s["rss"] if self.version == 1 else s["anon"]

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def prefix(self) -> list[str]:
        """A command prefix that runs the rest of the command inside this group from its first instruction."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh"]

    def remove(self, timeout: float = 10.0) -> None:
        """SIGKILL what still runs in the group, wait until it is empty, remove it."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        self.path.rmdir()


def own_memory_cgroup() -> MemoryCgroup:
    """This process's memory cgroup (v1 ``memory`` controller, else the v2 unified one), or CgroupUnavailable."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return MemoryCgroup(ROOT / "memory" / path.lstrip("/"), 1)
    for line in lines:
        if line.startswith("0::") and (ROOT / "cgroup.controllers").exists():
            return MemoryCgroup(ROOT / line[3:].lstrip("/"), 2)
    raise CgroupUnavailable("no memory cgroup in /proc/self/cgroup (neither a v1 memory controller nor cgroup v2)")


@contextlib.contextmanager
def child_memory_cgroup(name: str) -> Iterator[MemoryCgroup]:
    """A fresh child of this process's memory cgroup, removed (its processes killed) on exit."""
    parent = own_memory_cgroup()
    if parent.version == 2:
        control = parent.path / "cgroup.subtree_control"
        try:  # refused (EBUSY) if the parent holds processes itself: the v2 "no internal processes" rule
            if "memory" not in control.read_text().split():
                control.write_text("+memory")
        except OSError as exc:
            raise CgroupUnavailable(f"cannot enable the memory controller for children of {parent.path}: {exc}") from None
    path = parent.path / f"{name}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot create a memory cgroup under {parent.path}: {exc}") from None
    group = MemoryCgroup(path, parent.version)
    try:
        missing = [f for f in FILES[group.version][:4] if not (path / f).exists()]
        if missing:
            raise CgroupUnavailable(f"{path} has no {', '.join(missing)}: the memory controller is not enabled there (or the kernel is too old)")
        yield group
    finally:
        group.remove()
