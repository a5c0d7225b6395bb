"""`moeswarm bench soak`: a gateway serving 8 sessions for many minutes while workers come and go and the relay restarts.

The swarm (all real processes on loopback): a bootstrap node, a relay on a fixed port, two replicas
of each half of the embedded model's experts (one replica of the second half reachable only through
the relay) and a gateway (`backbone serve --max-batch 8`). Eight client sessions ask for greedy
completions in a loop; each answer is compared with the text single-process generation gives, so
a lost or wrong token shows. Meanwhile, every few seconds one worker whose range has a live replica
is killed (SIGKILL or SIGTERM, alternately) and brought back a while later; the relay is restarted
on a longer period. Reported: requests and tokens served, wrong and failed answers, request and
per-token latency percentiles, churn events.
"""

from __future__ import annotations

import random
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from experts.embedded import EMBEDDED_MODEL
from experts.forward import local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import make_kernel
from experts.moe import Partition, grouped_moe
from experts.tokenizer import Tokenizer
from node.launcher import Cluster, LaunchError, NodeProcess

PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd", "And it came to pass", "Blessed are the meek", "Let there be light", "Thus saith the LORD", "Hear, O Israel"]
MAX_TOKENS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_texts(model: GGUFModel, part: Partition) -> dict[str, str]:
    """What single-process greedy generation gives for each prompt, with the swarm's expert grouping."""
    from experts.forward import Backbone

    kernel = make_kernel("ggml", 1)
    bb, store = Backbone(model, kernel), open_experts(model, kernel)[0]
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    out = {}
    for prompt in PROMPTS:
        moe = local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w))
        tokens = [t for t, _ in generate(bb, tok.encode(prompt), MAX_TOKENS, moe, stop={tok.eos_id})]
        out[prompt] = tok.decode([t for t in tokens if t != tok.eos_id])
    return out


class _Client(threading.Thread):
    def __init__(self, url: str, session: int, want: dict[str, str], until: float, max_requests: int) -> None:
        super().__init__(daemon=True)
        self.url, self.session, self.want, self.until, self.max_requests = url, session, want, until, max_requests
        self.latencies: list[float] = []
        self.per_token: list[float] = []
        self.wrong: list[dict] = []
        self.failed: list[str] = []
        self.tokens = 0

    def run(self) -> None:
        prompt = PROMPTS[self.session % len(PROMPTS)]
        with httpx.Client(timeout=120) as http:
            for _ in range(self.max_requests):
                if time.monotonic() >= self.until:
                    return
                t0 = time.monotonic()
                try:
                    r = http.post(f"{self.url}/completions", json={"model": "embedded", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
                                  headers={"X-Session-Id": f"soak-{self.session}"})  # fmt: skip
                except httpx.HTTPError as exc:
                    self.failed.append(f"{type(exc).__name__}: {exc}")
                    continue
                dt = time.monotonic() - t0
                if r.status_code != 200:
                    self.failed.append(f"HTTP {r.status_code}: {r.text[:200]}")
                    continue
                body = r.json()
                n = body["usage"]["completion_tokens"]
                self.latencies.append(dt)
                self.per_token.append(dt / max(n, 1))
                self.tokens += n
                if body["choices"][0]["text"] != self.want[prompt]:
                    self.wrong.append({"prompt": prompt, "got": body["choices"][0]["text"], "want": self.want[prompt]})


def run(minutes: float, churn_every: float, down_s: float, relay_every: float, max_requests: int, seed: int) -> dict:
    model = GGUFModel(EMBEDDED_MODEL)
    half = model.cfg.n_expert // 2
    part = Partition(((0, half), (half, model.cfg.n_expert)))
    want = expected_texts(model, part)
    rng = random.Random(seed)
    events = {"killed": 0, "terminated": 0, "restarted": 0, "restart_failures": 0, "relay_restarts": 0}
    restart_errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="moeswarm-soak-") as tmp, Cluster(Path(tmp)) as cluster:
        relay = cluster.start("relay", "relay", "--listen", f"127.0.0.1:{_free_port()}")
        relay_url = relay.wait_ready()["url"]
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        common = ["worker", "--model", str(model.path), "--bootstrap", boot, "--max-datagram", "16384"]
        ranges = {"a0": (0, ()), "b0": (0, ()), "a1": (1, ()), "b1": (1, ("--relay", relay_url, "--relay-only"))}
        workers: dict[str, NodeProcess] = {}
        for name, (g, extra) in ranges.items():
            a, b = part.bounds[g]
            workers[name] = cluster.start(name, *common, "--experts", f"{a}-{b - 1}", *extra)
        for w in workers.values():
            w.wait_ready(120)
        gw = cluster.start("gateway", "backbone", "serve", "--bootstrap", boot, "--http", "127.0.0.1:0", "--max-datagram", "16384", "--max-batch", "8")
        url = gw.wait_ready(120)["base_url"]
        start = time.monotonic()
        until = start + minutes * 60
        clients = [_Client(url, i, want, until, max_requests) for i in range(8)]
        for c in clients:
            c.start()
        down: dict[str, float] = {}  # worker -> when to bring it back
        next_churn, next_relay, sigkill = start + churn_every, start + relay_every, True
        while time.monotonic() < until and any(c.is_alive() for c in clients):
            now = time.monotonic()
            for name, back_at in list(down.items()):
                if now >= back_at:
                    try:
                        workers[name].start().wait_ready(120)
                        events["restarted"] += 1
                        del down[name]
                    except LaunchError as exc:  # a worker that fails to come back is a finding, not the end of the soak
                        events["restart_failures"] += 1
                        restart_errors.append(str(exc).splitlines()[-1])
                        workers[name].stop()
                        down[name] = time.monotonic() + down_s  # try again later
            if now >= next_churn:
                next_churn = now + churn_every
                up = [n for n in workers if n not in down and not any(m in down for m in workers if m != n and ranges[m][0] == ranges[n][0])]
                if up:
                    name = rng.choice(up)
                    (workers[name].kill if sigkill else workers[name].stop)()
                    events["killed" if sigkill else "terminated"] += 1
                    sigkill = not sigkill
                    down[name] = time.monotonic() + down_s
            if now >= next_relay:
                next_relay = now + relay_every
                relay.kill()
                relay.start().wait_ready(60)
                events["relay_restarts"] += 1
            time.sleep(0.2)
        for c in clients:
            c.join(timeout=180)
        elapsed = time.monotonic() - start
    lat = [x for c in clients for x in c.latencies]
    per_token = [x for c in clients for x in c.per_token]
    wrong = [w for c in clients for w in c.wrong]
    failed = [f for c in clients for f in c.failed]

    def pct(xs: list[float], q: float) -> float | None:
        return round(float(np.percentile(xs, q)) * 1e3, 1) if xs else None

    return {
        "minutes": round(elapsed / 60, 2),
        "sessions": len(clients),
        "requests_ok": len(lat),
        "tokens": sum(c.tokens for c in clients),
        "wrong_answers": len(wrong),
        "failed_requests": len(failed),
        "request_latency_ms": {"p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99), "max": pct(lat, 100)},
        "per_token_ms": {"p50": pct(per_token, 50), "p99": pct(per_token, 99)},
        "churn": events,
        "first_wrong": wrong[:3],
        "first_failures": failed[:5],
        "restart_errors": restart_errors[:5],
    }
