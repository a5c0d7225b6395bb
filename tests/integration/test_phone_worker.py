"""A phone-class worker: a >= 200 MB Q4_K slice served under a hard memory limit of baseline + 1.3x the slice.

The worker computes on the slice's memory-mapped quantized bytes (``--kernel ggml``), so it must
load, check, warm and serve the slice without ever holding a copy of it in anonymous memory. The
test measures the baseline (the same worker process on a one-expert slice of the same model,
loaded and serving the same dispatches) in an unlimited memory cgroup, then starts the big worker
in a fresh cgroup limited to baseline + 1.3 x the slice file's size. The file's page cache is
charged to that cgroup too (the test drops its own copy of the file's pages first) but is
reclaimable: over the limit the kernel evicts pages; it OOM-kills only what cannot be evicted.
As a control, the same worker with the reference kernel's float32 cache (~7x the slice, what
every worker needed before the packed kernel) must be OOM-killed under the same limit.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from experts.gguf_model import ExpertRange, GGUFModel
from experts.moe import Partition, grouped_moe
from experts.packed_experts import PackedExperts
from experts.random_model import random_config, write_random_model
from experts.slices import write_slice
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.launcher import Cluster, LaunchError, NodeProcess
from p2p.identity import Identity
from tests.support.cgroups import CgroupUnavailable, MemoryCgroup, child_memory_cgroup
from tests.support.engine import kernel

pytestmark = pytest.mark.slow
MB = 1 << 20
N_EXPERT = 80  # x 2.53 MiB of Q4_K gate/up/down each (hidden 2048, FFN 768): a 202.5 MiB slice of one layer
BATCHES = (1, 2, 5, 8, 17)  # rows per dispatch: decode-sized and prefill-sized


@dataclass(frozen=True)
class Files:
    model: GGUFModel
    big: Path  # every expert of the model's one layer
    tiny: Path  # expert 0 only: the worker process with (almost) no experts loaded


@dataclass(frozen=True)
class Run:
    peak: int  # the cgroup's peak charge (anonymous + page cache + kernel), bytes
    anon: int  # anonymous memory charged after serving, bytes
    hwm: int  # the worker's own peak RSS (VmHWM), bytes
    oom_kills: int
    alive: bool
    remote: list[np.ndarray]
    local_groups: int
    per_peer: set[str]
    peer: str

    def describe(self) -> str:
        return f"peak {self.peak / MB:.1f} MiB (anon {self.anon / MB:.1f}, VmHWM {self.hwm / MB:.1f}, OOM kills {self.oom_kills})"


def drop_page_cache(path: Path) -> None:
    """Write back and evict *path*'s cached pages, so the worker's reads are charged to the worker's cgroup."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    d = tmp_path_factory.mktemp("phone")
    cfg = random_config("qwen3moe", n_layer=1, n_embd=2048, n_head=16, n_head_kv=4, head_dim=128, n_expert=N_EXPERT, n_expert_used=8, n_ff_exp=768)
    write_random_model(d / "model.gguf", cfg, qtype=gguf.GGMLQuantizationType.Q4_K)
    model = GGUFModel(d / "model.gguf")
    big = write_slice(model, range(1), ExpertRange(0, N_EXPERT), d / "big.gguf")
    tiny = write_slice(model, range(1), ExpertRange(0, 1), d / "tiny.gguf")
    drop_page_cache(big)
    return Files(model, big, tiny)


def dispatches(cfg) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    out = []
    for n in BATCHES:
        x = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        # Expert 0 and 7 others, in random slots: every row also reaches the one-expert baseline worker.
        rows = [rng.permutation(np.r_[0, 1 + rng.permutation(cfg.n_expert - 1)[: cfg.n_expert_used - 1]]) for _ in range(n)]
        ids = np.stack(rows).astype(np.int64)
        w = rng.random((n, cfg.n_expert_used)).astype(np.float32)
        out.append((x, ids, w / w.sum(axis=1, keepdims=True)))
    return out


async def dispatch_all(model: GGUFModel, boot: str) -> tuple[list[np.ndarray], dict]:
    async with backbone_session(Identity.generate(), model, [boot], kernel(), BackboneOptions(timeout=30.0)) as moe:
        await wait_for_hosts(moe, model.layers, 1, 60)
        remote = [await moe.dispatch_layer(0, x, ids, w) for x, ids, w in dispatches(model.cfg)]
        return remote, moe.stats.summary()


def vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def start_worker(cluster: Cluster, name: str, files: Files, slice_path: Path, boot: str, group: MemoryCgroup, kernel_name: str) -> NodeProcess:
    args = ["worker", "--slice", str(slice_path), "--model-digest", files.model.digest, "--bootstrap", boot, "--kernel", kernel_name, "--threads", "1", "--no-ledger"]
    return cluster.start(name, *args, prefix=group.prefix())


def serve_in_cgroup(cluster: Cluster, name: str, files: Files, slice_path: Path, boot: str, limit: int | None) -> Run:
    """Start a worker on *slice_path* inside a fresh memory cgroup (limited to *limit* bytes), dispatch, measure."""
    with child_memory_cgroup(name) as group:
        if limit is not None:
            group.limit(limit)
        node = start_worker(cluster, name, files, slice_path, boot, group, "ggml")
        info = node.wait_ready(180)
        remote, summary = asyncio.run(dispatch_all(files.model, boot))
        assert node.proc is not None
        alive = node.proc.poll() is None
        run = Run(group.peak(), group.anon(), vm_hwm(node.proc.pid) if alive else 0, group.oom_kills(), alive, remote, summary["local_groups"], set(summary["per_peer"]), info["peer_id"])
        node.stop()
        return run


def killed_in_cgroup(cluster: Cluster, name: str, files: Files, boot: str, limit: int) -> int:
    """The control: the reference kernel's float32 cache (~7x the slice) under the same limit; its OOM kills."""
    with child_memory_cgroup(name) as group:
        group.limit(limit)
        node = start_worker(cluster, name, files, files.big, boot, group, "reference")
        with pytest.raises(LaunchError, match="exited with code -9"):
            node.wait_ready(180)
        return group.oom_kills()


@pytest.fixture(scope="module")
def cgroups() -> None:
    """Skip (saying why) unless this process may create memory cgroups."""
    try:
        with child_memory_cgroup("probe"):
            pass
    except CgroupUnavailable as exc:
        pytest.skip(f"needs a writable memory cgroup: {exc}")


def test_phone_class_worker_serves_a_200mb_slice_within_baseline_plus_1_3x(cgroups, files, tmp_path):
    """Loads (self-test, slice hash check, warm) and serves bit-exact dispatches under baseline + 1.3 x slice,
    where the same worker with the float32 reference cache is OOM-killed."""
    size = files.big.stat().st_size
    assert size >= 200 * MB
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        base = serve_in_cgroup(cluster, "baseline", files, files.tiny, boot, None)
        limit = base.peak + int(1.3 * size)
        phone = serve_in_cgroup(cluster, "phone", files, files.big, boot, limit)
        float32_kills = killed_in_cgroup(cluster, "float32", files, boot, limit)
    print(f"\nslice {size / MB:.1f} MiB; baseline {base.describe()}; limit {limit / MB:.1f} MiB; phone {phone.describe()}")  # the numbers, with -s
    assert base.alive and base.oom_kills == 0 and base.per_peer == {base.peer}
    assert phone.alive and phone.oom_kills == 0
    assert phone.peak <= limit
    # No copy of the slice in anonymous memory: what the big worker holds beyond the baseline is page cache.
    assert phone.anon - base.anon < 0.25 * size
    assert float32_kills >= 1  # the limit is real: a worker that copies the slice to float32 does not survive it
    assert phone.local_groups == 0 and phone.per_peer == {phone.peer}
    local = PackedExperts(files.model, kernel())
    whole = Partition(((0, N_EXPERT),))
    for (x, ids, w), got in zip(dispatches(files.model.cfg), phone.remote):
        assert got.tobytes() == grouped_moe(local, whole, 0, x, ids, w).tobytes()
