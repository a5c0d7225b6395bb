"""`moeswarm bench wan`'s measurement: decoding across an emulated WAN in the real-NAT testbed, technique by technique (root).

Per RTT, a fresh testbed with three public workers (a third of the experts each) and the backbone `RTT` apart:
``naive`` (one token per forward pass, the shared expert after the round trip), ``+speculative`` (drafts verified
in one pass), ``+overlap`` (shared expert during the round trip), ``+hot-local`` (the hottest experts at the
backbone) = ``all``. All on the F32 wire, so every variant must produce the same tokens (reported). The bound is
one round trip per MoE layer per token: ``1000 / (layers x RTT)`` tokens/s for plain decoding.

At the largest RTT: 8 concurrent gateway sessions vs the same 8 requests one at a time (continuous batching), and a
star check: workers 20/40/80 ms from the backbone, a layer that fans out to all three should take ~80 ms, not 140.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from experts.embedded import DEFAULT_PROMPT, EMBEDDED_MODEL
from experts.gguf_model import GGUFModel
from experts.moe import Progress
from node.bench.common import REFERENCE, BenchmarkError, message_bytes
from node.launcher import Cluster
from node.testbed.netns import require_root

WORKERS = ("pub-worker", "pub-worker-2", "pub-worker-3")
EXPERT_RANGES = ("0-10", "11-21", "22-31")
STAR_LINKS_MS = {"pub-worker": 20.0, "pub-worker-2": 40.0, "pub-worker-3": 80.0}
LOCAL_EXPERTS = 8  # of 32 per layer: a quarter of the experts' memory at the backbone
VARIANTS = {  # name -> extra `backbone generate` options; each adds one technique to the one before
    "naive": ("--no-speculative", "--no-overlap"),
    "speculative": ("--no-overlap",),
    "overlap": (),
    "all": ("--local-experts", str(LOCAL_EXPERTS)),
}
PROMPTS = (
    "And the LORD said unto Moses,",
    "In the beginning God created",
    "And it came to pass, when",
    "Blessed are they that",
    "And Jesus answered and said unto them,",
    "The LORD is my shepherd;",
    "And the king said unto",
    "For God so loved the world,",
)


def _swarm(tb, cluster):
    """Bootstrap and the three workers; returns the swarm and the workers' peer ids (in WORKERS order)."""
    from node.testbed.nodes import SwarmInTestbed

    swarm = SwarmInTestbed(tb, cluster)
    swarm.start_bootstrap()
    workers = [swarm.start_worker(f"w{i}", role, "--experts", experts) for i, (role, experts) in enumerate(zip(WORKERS, EXPERT_RANGES))]
    return swarm, [w.wait_ready()["peer_id"] for w in workers]


def decode_variants(rtt_ms: float, n_tokens: int, workdir: Path, n_moe_layers: int, prompts: tuple[str, ...]) -> dict:
    """tokens/s of each variant over `prompts` at `rtt_ms` (backbone <-> every worker), and the plain-decoding bound."""
    from node.testbed.netns import Testbed

    with Testbed(rtt_ms=rtt_ms, public_workers=3) as tb, Cluster(workdir) as cluster:
        swarm, _ = _swarm(tb, cluster)
        runs = {name: [swarm.generate(f"{name}{i}", prompt, n_tokens, "--wire", "f32", "--wait-hosts", "3", *extra) for i, prompt in enumerate(prompts)]
                for name, extra in VARIANTS.items()}  # fmt: skip
    tokens_s = {name: round(sum(r["tokens"] for r in rs) / sum(r["tokens"] / r["tokens_per_s"] for r in rs), 3) for name, rs in runs.items()}
    bound = 1000.0 / (n_moe_layers * rtt_ms) if rtt_ms > 0 else None
    spec = [r["speculative"] for r in runs["speculative"]]
    return {
        "rtt_ms": rtt_ms,
        "tokens_s": tokens_s,
        "speedup": {name: round(v / tokens_s["naive"], 3) for name, v in tokens_s.items() if name != "naive"},
        "bound_tokens_s": round(bound, 3) if bound else None,
        "of_bound": {name: round(v / bound, 3) for name, v in tokens_s.items()} if bound else None,
        "acceptance_mean": round(sum(x["accepted"] for x in spec) / max(1, sum(x["steps"] for x in spec)), 3),  # accepted draft tokens per verify pass
        "tokens_per_pass": round(sum(x["tokens"] for x in spec) / sum(x["forward_passes"] for x in spec), 3),
        "local_hit_rate": round(sum(r["local_hit_rate"] for r in runs["all"]) / len(prompts), 4),
        "identical": all(r["token_ids"] == naive["token_ids"] for rs in runs.values() for r, naive in zip(rs, runs["naive"])),
        "failed_dispatches": sum(r["failed_dispatches"] for rs in runs.values() for r in rs),
        "layer_ms_p50": {name: round(float(np.median([r["layer_ms"]["p50"] for r in rs])), 3) for name, rs in runs.items()},
    }


async def _complete(session, url: str, prompt: str, n_tokens: int) -> int:
    body = {"model": "embedded", "prompt": prompt, "max_tokens": n_tokens, "temperature": 0}
    async with session.post(f"{url}/completions", json=body) as resp:
        if resp.status != 200:
            raise BenchmarkError(f"gateway answered {resp.status}: {await resp.text()}")
        return (await resp.json())["usage"]["completion_tokens"]


def _drive(url: str, n_tokens: int, rounds: int) -> dict:
    """One client sending the 8 prompts one after another, then 8 clients at once, each sending `rounds` requests
    back to back (client i starts at prompt i): aggregate tokens/s of each. Back-to-back requests keep the batch
    full, as steady traffic would; with a single wave the last, slowest sequence would decode alone at the end.
    Runs inside the backbone's namespace."""
    import aiohttp

    async def client(session, first: int) -> int:
        return sum([await _complete(session, url, PROMPTS[(first + r) % len(PROMPTS)], n_tokens) for r in range(rounds)])

    async def batching(session) -> dict:
        async with session.get(f"{url}/stats") as resp:
            return (await resp.json())["batching"]

    async def run() -> dict:
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await _complete(session, url, PROMPTS[0], 4)  # warm-up: connections, caches
            t0 = time.perf_counter()
            one = [await _complete(session, url, p, n_tokens) for p in PROMPTS]
            t1, before = time.perf_counter(), await batching(session)
            many = await asyncio.gather(*(client(session, i) for i in range(len(PROMPTS))))
            t2, after = time.perf_counter(), await batching(session)
        calls, dispatches = (after[k] - before[k] for k in ("member_calls", "layer_dispatches"))
        return {"one_session_tokens_s": round(sum(one) / (t1 - t0), 3), "sessions8_tokens_s": round(sum(many) / (t2 - t1), 3), "requests_per_session": rounds,
                "sessions_per_dispatch": round(calls / max(1, dispatches), 2)}  # how full the concurrent phase kept the batch

    return asyncio.run(run())


def sessions(rtt_ms: float, n_tokens: int, rounds: int, workdir: Path) -> dict:
    """Continuous batching through the gateway: 8 concurrent sessions vs one at a time, without speculation (each
    pass then yields one token per session, so the ratio is the batching alone) and with it."""
    from node.testbed.netns import Testbed

    out = {}
    with Testbed(rtt_ms=rtt_ms, public_workers=3) as tb, Cluster(workdir) as cluster:
        swarm, _ = _swarm(tb, cluster)
        for name, extra in (("plain", ("--no-speculative",)), ("speculative", ())):
            gw = swarm.start(f"gateway-{name}", "backbone", "backbone", "serve", *swarm.backbone_args(), "--http", f"{tb.addr('backbone')}:0",
                             "--wire", "f32", "--wait-hosts", "3", "--served-model-name", "embedded", *extra)  # fmt: skip
            got = tb.call("backbone", _drive, gw.wait_ready(120)["base_url"], n_tokens, rounds)
            gw.stop()
            out[name] = {**got, "ratio": round(got["sessions8_tokens_s"] / got["one_session_tokens_s"], 3)}
    return out


def star(n_tokens: int, workdir: Path) -> dict:
    """Workers 20/40/80 ms from the backbone: the median layer that fanned out to all three, against the slowest
    worker's RTT as configured and as measured (its median dispatch round trip, which includes its compute)."""
    from node.testbed.netns import Testbed

    links = {"backbone": 0.0, **STAR_LINKS_MS}
    with Testbed(rtt_ms=0, links=links, public_workers=3) as tb, Cluster(workdir) as cluster:
        swarm, peers = _swarm(tb, cluster)
        run = swarm.generate("star", DEFAULT_PROMPT, n_tokens, "--wire", "f32", "--wait-hosts", "3", "--no-speculative")
        rtts = [tb.rtt("backbone", role) for role in WORKERS]
    fanned = run["layer_ms"]["by_fanout"].get("3")
    if not fanned:
        raise BenchmarkError("no layer fanned out to all three workers; generate more tokens")
    slowest = run["rtt_ms_by_peer"][peers[rtts.index(max(rtts))]]
    return {"rtts_ms": rtts, "layer_ms": fanned["p50"], "layers": fanned["n"], "max_rtt_ms": max(rtts), "sum_rtt_ms": sum(rtts), "ratio": round(fanned["p50"] / max(rtts), 3),
            "slowest_dispatch_ms": slowest, "ratio_to_slowest_dispatch": round(fanned["p50"] / slowest, 3), "failed_dispatches": run["failed_dispatches"]}  # fmt: skip


def plot(by_rtt: list[dict], bytes_per_codec: dict, out_dir: Path) -> list[str]:
    """tokens/s vs RTT per technique (with the bound), and wire bytes per codec; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rtts = [r["rtt_ms"] for r in by_rtt]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("naive", "naive"), ("speculative", "+ speculative"), ("overlap", "+ overlap"), ("all", "+ hot-local (all)")):
        ax.plot(rtts, [r["tokens_s"][name] for r in by_rtt], marker="o", label=label)
    bounded = [(r["rtt_ms"], r["bound_tokens_s"]) for r in by_rtt if r["bound_tokens_s"]]
    if bounded:
        ax.plot(*zip(*bounded), linestyle="--", marker="x", color="grey", label="plain-decoding bound: 1 / (MoE layers x RTT)")
    ax.set(xlabel="RTT backbone <-> workers (ms)", ylabel="tokens/s", yscale="log", title="Embedded model across the emulated WAN")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    tokens_png = out_dir / "wan_tokens_s.png"
    fig.savefig(tokens_png, dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(bytes_per_codec)
    ax.bar(names, [bytes_per_codec[n] for n in names])
    ax.set(ylabel="bytes per token per layer", title="Wire bytes, reference config (hidden 3072, top-8)")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    bytes_png = out_dir / "wan_bytes.png"
    fig.savefig(bytes_png, dpi=120)
    plt.close("all")
    return [str(tokens_png), str(bytes_png)]


def run(rtt_list: list[float], n_tokens: int, n_prompts: int, session_tokens: int, session_rounds: int, star_tokens: int, plot_dir: Path | None, progress: Progress | None = None) -> dict:
    """The whole `bench wan` measurement (root only: it builds testbeds); returns the result published under its command
    (*progress* hears after each RTT, the sessions check and the star check)."""
    if n_prompts > len(PROMPTS):
        raise BenchmarkError(f"--prompts {n_prompts}: bench wan has {len(PROMPTS)} prompts")
    require_root()
    model = GGUFModel(EMBEDDED_MODEL)
    n_moe = len(model.layers)  # every layer of the embedded model is a MoE layer
    reference = message_bytes(REFERENCE["n_embd"], REFERENCE["n_expert_used"])
    with tempfile.TemporaryDirectory(prefix="moeswarm-wan-") as tmp:
        steps = len(rtt_list) + 2

        def done(n: int) -> None:
            if progress:
                progress(n, steps)

        by_rtt = []
        for rtt in rtt_list:
            by_rtt.append(decode_variants(rtt, n_tokens, Path(tmp) / f"rtt{rtt:g}", n_moe, PROMPTS[:n_prompts]))
            done(len(by_rtt))
        top = by_rtt[-1]
        batching = sessions(top["rtt_ms"], session_tokens, session_rounds, Path(tmp) / "sessions")
        done(steps - 1)
        star_result = star(star_tokens, Path(tmp) / "star")
        done(steps)
        result = {
            **top,
            "sessions8_aggregate_ratio": batching["plain"]["ratio"],  # the batching alone; with speculation in "sessions"
            "sessions": batching,
            "star": star_result,
            "bytes_per_token_per_layer": {"f16": reference["partial_f16"]["total"], "int8": reference["partial_int8"]["total"], "f32": reference["partial_f32"]["total"], "raw_f32": reference["raw_f32"]["total"]},
            "moe_layers": n_moe,
            "by_rtt": by_rtt,
        }
    if plot_dir:
        result["plots"] = plot(by_rtt, result["bytes_per_token_per_layer"], plot_dir)
    return result
