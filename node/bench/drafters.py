"""`moeswarm bench drafters`'s measurement: MTP vs n-gram drafts on the same random models, locally and over a WAN.

Two models with an MTP block: a random glm4moe (3 layers, one dense; its MTP head is random, so its drafts are
rejected: acceptance there proves the plumbing, not the gain) and the restating model of
:func:`experts.random_model.write_restating_mtp_model`, whose block predicts what the trunk will (the most a
trained head could give, for reference). Each is decoded greedily with no drafts (``plain``), with prompt lookup
(``ngram``: no table ships beside a random model) and with its MTP block (``mtp``); all must give the same tokens.

Locally: in process, experts on this machine. Over the WAN (root; skipped with ``rtt_ms`` 0): a testbed with the
backbone ``rtt_ms`` from one public worker holding every expert, ``backbone generate --drafter ...`` runs.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Progress, ungrouped_moe
from experts.random_model import random_config, write_random_model, write_restating_mtp_model
from experts.slices import ExpertStore
from experts.speculative import SpecStats, pick_drafter, speculative_generate
from experts.tokenizer import Tokenizer
from node.launcher import Cluster
from node.testbed.netns import require_root

PROMPTS = ("the cat sat on the mat and the cat", "Hello world, hello", "in the beginning was the")
VARIANTS = {"plain": ("--no-speculative",), "ngram": ("--drafter", "ngram"), "mtp": ("--drafter", "mtp")}


def models(directory: Path) -> dict[str, Path]:
    """The two models measured: a random glm4moe with its MTP block, and the restating one."""
    paths = {"random": directory / "glm4moe-random.gguf", "restating": directory / "glm4moe-restating.gguf"}
    write_random_model(paths["random"], random_config("glm4moe", n_layer=3, n_embd=64, n_ff_exp=32), seed=1)
    write_restating_mtp_model(paths["restating"], "glm4moe", n_embd=64, n_ff_exp=32, seed=1)
    return paths


def _summary(stats: SpecStats | None, tokens: int, seconds: float) -> dict:
    out = {"tokens_s": round(tokens / seconds, 3)}
    if stats is not None:
        s = stats.summary()
        out |= {"accepted_per_verify_pass": s["mean_accepted_per_step"], "acceptance_rate": s["acceptance_rate"], "tokens_per_pass": s["tokens_per_pass"]}
    return out


def local(path: Path, n_tokens: int, prompts: tuple[str, ...]) -> dict:
    """Each variant over *prompts* in process: tokens/s, and for the drafters accepted tokens per verify pass."""
    model = GGUFModel(path)
    bb, store, tok = Backbone(model), ExpertStore(model), Tokenizer.from_spec(model.tokenizer_spec)
    hook = local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))
    ids = [tok.encode(p) for p in prompts]
    drafters = {name: pick_drafter(bb, name) for name in VARIANTS if name != "plain"}
    list(speculative_generate(bb, ids[0], 4, hook, drafter=drafters["mtp"]))  # warm-up: every expert dequantized once
    out, reference = {}, None
    for name in VARIANTS:
        stats = None if name == "plain" else SpecStats()
        drafter = drafters.get(name)
        t0, runs = time.perf_counter(), []
        for p in ids:
            run = generate(bb, p, n_tokens, hook) if drafter is None else speculative_generate(bb, p, n_tokens, hook, drafter=drafter, stats=stats)
            runs.append([t for t, _ in run])
        out[name] = _summary(stats, sum(map(len, runs)), time.perf_counter() - t0)
        reference = reference or runs
        out[name]["identical"] = runs == reference
    return out


def wan(path: Path, rtt_ms: float, n_tokens: int, prompts: tuple[str, ...], workdir: Path) -> dict:
    """Each variant over *prompts* as `backbone generate` runs `rtt_ms` from the one worker (root)."""
    from node.testbed.netns import Testbed
    from node.testbed.nodes import SwarmInTestbed

    with Testbed(rtt_ms=rtt_ms) as tb, Cluster(workdir) as cluster:
        swarm = SwarmInTestbed(tb, cluster, model=path)
        swarm.start_bootstrap()
        swarm.start_worker("w0", "pub-worker").wait_ready()
        runs = {name: [swarm.generate(f"{name}{i}", p, n_tokens, "--wire", "f32", *extra) for i, p in enumerate(prompts)] for name, extra in VARIANTS.items()}
    out = {}
    for name, rs in runs.items():
        tokens, seconds = sum(r["tokens"] for r in rs), sum(r["tokens"] / r["tokens_per_s"] for r in rs)
        spec = [r["speculative"] for r in rs] if name != "plain" else []
        out[name] = {"tokens_s": round(tokens / seconds, 3), "identical": [r["token_ids"] for r in rs] == [r["token_ids"] for r in runs["plain"]]}
        if spec:
            out[name] |= {
                "accepted_per_verify_pass": round(sum(s["accepted"] for s in spec) / max(1, sum(s["steps"] for s in spec)), 3),
                "tokens_per_pass": round(sum(s["tokens"] for s in spec) / sum(s["forward_passes"] for s in spec), 3),
            }
    return out


def run(rtt_ms: float, n_tokens: int, n_prompts: int, progress: Progress | None = None) -> dict:
    """The whole `bench drafters` measurement; the WAN part needs root (*progress* hears after each model and place)."""
    if rtt_ms > 0:
        require_root()
    prompts = PROMPTS[:n_prompts]
    steps = 4 if rtt_ms > 0 else 2
    done = 0
    result: dict = {"note": "a random model's MTP head is random: its acceptance proves the plumbing, not the gain; the restating model's block predicts what the trunk will"}
    with tempfile.TemporaryDirectory(prefix="moeswarm-drafters-") as tmp:
        for kind, path in models(Path(tmp)).items():
            result[kind] = {"local": local(path, n_tokens, prompts)}
            done += 1
            if progress:
                progress(done, steps)
            if rtt_ms > 0:
                result[kind][f"wan_{rtt_ms:g}ms"] = wan(path, rtt_ms, n_tokens, prompts, Path(tmp) / f"cluster-{kind}")
                done += 1
                if progress:
                    progress(done, steps)
    return result
