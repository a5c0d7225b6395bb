"""`moeswarm bench federation`: several backbones decoding at once against one pool of workers (issue 29, item 3).

The way volunteers' capacity is meant to be used: many backbone operators, one pool. A bootstrap and the workers
(the demo's, each an equal share of every layer's experts, one thread) and the largest count of gateways
(`moeswarm backbone serve`, one kernel thread each, the user's defaults but no prefix cache, so a repeated prompt is
decoded every time) run as real processes; for each count N (1, 2, 4 by default), in alternating rounds, N of the
gateways get one greedy completion request each at the same moment. Reported per N: the aggregate tokens/s (every
completion token over the wall time from the first request to the last answer), each backbone's own tokens/s, Jain's
fairness index over those, failed requests, the workers' refusals the gateways saw (a saturated worker answers
OVERLOADED and the backbone asks a replica), and whether every text equals the single-process run's.

On a 2-core machine every process shares the same cores, so the aggregate measures how well the swarm's waits
overlap, not what N machines would add; the JSON carries the load average for that reason.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experts.embedded import DEFAULT_PROMPT
from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import make_kernel
from experts.moe import Partition, grouped_moe
from experts.tokenizer import Tokenizer
from node.bench.common import BenchmarkError
from node.launcher import LOOPBACK_DATAGRAM, Cluster, start_local_swarm

SERVED = "bench"  # the gateways' --served-model-name
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Answer:
    """One completion request's outcome, timed by the client."""

    started: float
    ended: float
    tokens: int
    text: str | None  # None: the request failed (`error` says how)
    error: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.ended - self.started, 1e-9)


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when every backbone got the same, 1/n when one got everything."""
    x = np.asarray(values, dtype=np.float64)
    return float(x.sum() ** 2 / (len(x) * (x * x).sum())) if len(x) and (x * x).sum() > 0 else 0.0


def local_text(model: GGUFModel, part: Partition, prompt: str, n_tokens: int) -> str:
    """What a gateway must answer: single-process greedy decoding with the workers' expert grouping (same bits),
    stopped at end of sequence as the gateway stops."""
    kernel = make_kernel("ggml", 1)
    bb, (store, _) = Backbone(model, kernel), open_experts(model, kernel)
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    hook = local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w))
    out = [t for t, _ in generate(bb, tok.encode(prompt), n_tokens, hook, stop={tok.eos_id})]
    return tok.decode([t for t in out if t != tok.eos_id])


def complete(base_url: str, prompt: str, n_tokens: int) -> Answer:
    """One greedy /v1/completions request; a failure is an Answer with its error, never an exception."""
    body = json.dumps({"model": SERVED, "prompt": prompt, "max_tokens": n_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base_url + "/completions", data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            reply = json.loads(resp.read())
        return Answer(started, time.perf_counter(), int(reply["usage"]["completion_tokens"]), reply["choices"][0]["text"])
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        return Answer(started, time.perf_counter(), 0, None, f"{type(exc).__name__}: {exc}")


def at_once(urls: list[str], prompt: str, n_tokens: int) -> list[Answer]:
    """One request to each gateway of *urls*, all sent together."""
    with ThreadPoolExecutor(len(urls)) as pool:
        return list(pool.map(lambda url: complete(url, prompt, n_tokens), urls))


def gateway_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/stats", timeout=30) as resp:
        return json.loads(resp.read())


def summarise(rounds: list[list[Answer]], want: str) -> dict:
    """Medians over the rounds of one count: aggregate and per-backbone tokens/s, Jain's index, failures, identity."""
    aggregate, jains, per_backbone = [], [], []
    for answers in rounds:
        wall = max(a.ended for a in answers) - min(a.started for a in answers)
        aggregate.append(sum(a.tokens for a in answers) / max(wall, 1e-9))
        jains.append(jain([a.tokens_per_s for a in answers]))
        per_backbone.append([a.tokens_per_s for a in answers])
    return {
        "aggregate_tps": round(float(np.median(aggregate)), 3),
        "per_backbone_tps": [round(float(v), 3) for v in np.median(np.asarray(per_backbone), axis=0)],
        "jain": round(float(np.median(jains)), 4),
        "failed": sum(a.text is None for answers in rounds for a in answers),
        "errors": sorted({a.error for answers in rounds for a in answers if a.error})[:3],
        "identical": all(a.text == want for answers in rounds for a in answers),
    }


def run(model_path: Path, n_workers: int, counts: tuple[int, ...], n_tokens: int, rounds: int) -> dict:
    """Start the pool and max(*counts*) gateways, warm each up, then for *rounds* rounds ask every count in turn."""
    if not counts or min(counts) < 1:
        raise BenchmarkError(f"--backbones must list counts of at least 1; got {counts}")
    load_start = os.getloadavg()
    model = GGUFModel(model_path)
    if not 1 <= n_workers <= model.cfg.n_expert:
        raise BenchmarkError(f"--workers must be between 1 and the model's {model.cfg.n_expert} experts; got {n_workers}")
    part = Partition.even(model.cfg.n_expert, n_workers)
    prompt = DEFAULT_PROMPT
    want = local_text(model, part, prompt, n_tokens)
    with tempfile.TemporaryDirectory(prefix="moeswarm-bench-federation-") as tmp, Cluster(Path(tmp) / "nodes") as cluster:
        boot, _ = start_local_swarm(cluster, model.path, part.bounds, kernel="ggml", max_datagram=LOOPBACK_DATAGRAM, ready_timeout=600)
        gateways = [
            cluster.start(f"gateway{i}", "backbone", "serve", "--model", str(model.path), "--bootstrap", boot["dht_addrs"][0], "--http", "127.0.0.1:0", "--served-model-name", SERVED, "--max-datagram", str(LOOPBACK_DATAGRAM), "--threads", "1", "--prefix-cache", "0", "--wait-timeout", "300")
            for i in range(max(counts))
        ]
        urls = [g.wait_ready(600)["base_url"] for g in gateways]
        warm = [complete(url, prompt, n_tokens) for url in urls]  # connections, RTT estimates, caches
        if failed := [a.error for a in warm if a.text is None]:
            raise BenchmarkError(f"a gateway failed its warm-up request: {failed[0]}")
        answers: dict[int, list[list[Answer]]] = {n: [] for n in counts}
        for _ in range(rounds):
            for n in counts:
                answers[n].append(at_once(urls[:n], prompt, n_tokens))
        stats = [gateway_stats(url) for url in urls]
    by_count = {str(n): summarise(answers[n], want) for n in counts}
    one = by_count[str(min(counts))]["aggregate_tps"]
    refusals: dict[str, int] = {}
    for s in stats:
        for code, k in s.get("dispatch", {}).get("refusals", {}).items():
            refusals[code] = refusals.get(code, 0) + k
    result = {
        "model": str(model.path),
        "config": {"arch": model.cfg.arch, "n_layer": model.cfg.n_layer, "n_embd": model.cfg.n_embd, "n_expert": model.cfg.n_expert, "n_expert_used": model.cfg.n_expert_used},
        "moe_layers": len(model.moe_layers),
        "workers": n_workers,
        "tokens": n_tokens,
        "rounds": rounds,
        "backbones": by_count,
        **{f"aggregate_ratio_{n}": round(by_count[str(n)]["aggregate_tps"] / one, 3) if one else 0.0 for n in counts},
        **{f"jain_{n}": by_count[str(n)]["jain"] for n in counts},
        "failed": sum(v["failed"] for v in by_count.values()),
        "identical": all(v["identical"] for v in by_count.values()),
        "worker_refusals": refusals,
        "failed_dispatches": sum(s.get("dispatch", {}).get("failed_dispatches", 0) for s in stats),
        "load": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
    }
    return result
