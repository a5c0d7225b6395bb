"""Shared fixtures: real GGUF files written per session (random weights, every supported arch)."""

from __future__ import annotations

import os

# OpenBLAS reads its thread count once, when numpy first loads it: set here, above every import that could pull numpy
# in (gguf does), not in a hook that runs after this module. Two BLAS threads on two cores spin against each other and
# the node processes the tests start: test_kernels.py burnt ~3x the CPU seconds. `./dev test` exports the same value.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import gguf  # noqa: E402
import pytest  # noqa: E402

from experts.random_model import random_config, write_random_model  # noqa: E402
from p2p.identity import Identity  # noqa: E402

ARCHS = ("qwen2moe", "qwen3moe", "llama")
# Archs of issue 12: checked against llama.cpp in test_reference and through a real swarm in test_swarm_archs.
NEW_ARCHS = ("olmoe", "glm4moe", "minimax-m2", "gpt-oss", "llama4")
NEW_ARCHS += ("qwen3vlmoe", "dots1", "ernie4_5-moe", "bailingmoe2")  # issue 12's cheap extras, held to the same tests
# Archs of issue 15, in the same tests (test_reference, test_swarm_archs).
ISSUE15_ARCHS = ("deepseek2", "qwen3next", "qwen35moe", "step35")
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Verdicts and keys written by a test stay in that test's directory."""
    monkeypatch.setenv("MOESWARM_HOME", str(tmp_path / "home"))


@pytest.fixture
def parties():
    """Three fresh identities for ledger tests: a backbone and two workers."""
    return Identity.generate(), Identity.generate(), Identity.generate()  # backbone, worker 1, worker 2


def make_model(directory: Path, arch: str, qtype=Q.F32, seed: int = 0, **shape) -> Path:
    shape = {"n_embd": 64, "n_ff_exp": 32, "n_expert": 8, "n_expert_used": 2, **shape}
    path = directory / f"{arch}-{qtype.name}-{seed}-{'-'.join(f'{k}{v}' for k, v in sorted(shape.items()))}.gguf"
    if not path.exists():
        write_random_model(path, random_config(arch, **shape), qtype=qtype, seed=seed)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def f32_models(model_dir) -> dict[str, Path]:
    """One small F32 model per architecture (4 experts of 8 chosen: top-2 of 8)."""
    return {arch: make_model(model_dir, arch) for arch in ARCHS}



# Modules that build network namespaces (iptables NAT, NFQUEUE, fixed 10.x subnets): with `pytest -n N` (pytest-xdist)
# they run one after another on one worker, so two testbeds never share the host's iptables and address plan.
NETNS_MODULES = frozenset({"tests/integration/test_sybil.py"})
NETNS_GROUP = "netns"


def xdist_group(rel: str) -> str:
    """The pytest-xdist group of the test module at *rel* (a path from the repository root): one group per module, so a
    module's shared swarm (module-scoped fixtures) starts once, on one worker; every netns module in one group."""
    return NETNS_GROUP if rel.startswith("tests/testbed/") or rel in NETNS_MODULES else rel


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist (`--dist loadgroup`, as `./dev test` runs it): mark each test with its module's group, and put the
    netns group first: it is the longest (several minutes of testbeds), and loadgroup hands groups out in collection
    order, so started last it would finish alone after every other worker is done."""
    if not config.pluginmanager.has_plugin("xdist") or not getattr(config.option, "numprocesses", None):
        return
    root = config.rootpath
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item.path.relative_to(root).as_posix())))
    items.sort(key=lambda item: xdist_group(item.path.relative_to(root).as_posix()) != NETNS_GROUP)
