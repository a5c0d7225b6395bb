"""`moeswarm bench ...`: measurements that go into BENCHMARKS.md (never assertions in tests).

Each command parses its options, calls its measurement in :mod:`node.bench` (imported when the
command runs) and publishes the result: appended under the command to a Markdown file if asked,
printed as JSON or as a short summary.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click

from node.bench.common import REFERENCE
from node.cli import progress
from node.cli.root import emit_json


@click.group("bench")
def bench_group() -> None:
    """Benchmarks; results go to BENCHMARKS.md with the command that produced them."""


def publish(result: dict, command: str, *, write_md: str | None, as_json: bool, lines: list[str]) -> None:
    """Every benchmark's ending: append `result` under the `command` that produced it to `write_md` (if given), then
    print it as JSON or as the human summary `lines`."""
    if write_md:
        with open(write_md, "a") as f:
            f.write(f"\n### `{command}` ({time.strftime('%Y-%m-%d')})\n\n```json\n{json.dumps(result, indent=1)}\n```\n")
    if as_json:
        emit_json(result)
    else:
        for line in lines:
            click.echo(line)


@bench_group.command("experts")
@click.option("--json", "as_json", is_flag=True)
@click.option("--repeat", default=5, show_default=True)
@click.option("--qtype", default="Q4_K", show_default=True)
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1), help="Threads of the fast kernel (ggml).")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_experts(as_json: bool, repeat: int, qtype: str, threads: int, write_md: str | None) -> None:
    """Expert compute per token per layer (reference config): cached, on-the-fly, the kernels vs the bandwidth floor; wire bytes."""
    from node.bench import experts

    result = experts.run(repeat, qtype, threads)
    compute = result["expert_compute"]
    lines = [f"{k}: {v}" for k, v in compute.items()]
    lines += [f"{k}: out {v['out']} B, back {v['back']} B, total {v['total']} B" for k, v in result["bytes_per_token_per_layer"].items()]
    publish(result, f"moeswarm bench experts --json --threads {threads}", write_md=write_md, as_json=as_json, lines=lines)


@bench_group.command("engine")
@click.option("--json", "as_json", is_flag=True)
@click.option("--layers", "n_layer", default=4, show_default=True, type=click.IntRange(1))
@click.option("--tokens", "n_tokens", default=32, show_default=True, type=click.IntRange(1), help="Decode steps timed per engine per round.")
@click.option("--prefill", "n_prefill", default=128, show_default=True, type=click.IntRange(1), help="Prompt tokens of the timed prefill.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1), help="Alternating rounds over the engines; medians are reported.")
@click.option("--qtype", default="Q4_K", show_default=True)
@click.option("--hidden", "n_embd", default=None, type=int, help="Model width instead of Qwen3-30B-A3B's 2048 (for a quick run).")
@click.option("--experts", "n_expert", default=None, type=int, help="Experts per layer instead of 128 (for a quick run; top-8 stays).")
@click.option("--model", "model_path", type=click.Path(dir_okay=False, exists=True), default=None, help="Bench this GGUF instead of writing a random one.")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_engine(as_json: bool, n_layer: int, n_tokens: int, n_prefill: int, rounds: int, qtype: str, n_embd: int | None, n_expert: int | None,
                 model_path: str | None, write_md: str | None) -> None:  # fmt: skip
    """moeswarm's local engine (ggml kernel) vs llama.cpp on a Qwen3-30B-A3B-shaped model: decode, prefill, peak RSS."""
    from node.bench import engine

    shape = {k: v for k, v in (("n_embd", n_embd), ("n_expert", n_expert)) if v is not None}
    with progress.bars(progress.wanted(as_json=as_json)) as shown:
        result = engine.run(n_layer, n_tokens, n_prefill, rounds, qtype, shape, model_path, progress=progress.stage(shown, "benchmark rounds"))
    d, p, r = result["decode"], result["prefill"], result["rss"]
    lines = [f"decode tokens/s: moeswarm {d['moeswarm_tps']} (2 threads {d['moeswarm_tps_2t']}), llama.cpp {d['llamacpp_tps_1t']} / {d['llamacpp_tps_2t']}; "
             f"ratio {d['ratio_1t']} (1 thread), {d['ratio_2t']} (2 threads)",
             f"prefill {n_prefill} tokens, tokens/s: moeswarm {p['moeswarm_tps']} / {p['moeswarm_tps_2t']}, llama.cpp {p['llamacpp_tps_1t']} / {p['llamacpp_tps_2t']}; "
             f"ratio {p['ratio_1t']}, {p['ratio_2t']}",
             "moeswarm decode step (1 thread): " + ", ".join(f"{k} {v}" for k, v in result["moeswarm_decode_step"].items()),
             f"moeswarm peak RSS {r['moeswarm_bytes'] / 1e6:.1f} MB for a {r['file_bytes'] / 1e6:.1f} MB file ({r['ratio']}x)"]  # fmt: skip
    command = f"moeswarm bench engine --json --layers {n_layer} --tokens {n_tokens} --prefill {n_prefill} --rounds {rounds} --qtype {qtype}"
    command += "".join(f" --{k} {v}" for k, v in (("hidden", n_embd), ("experts", n_expert), ("model", model_path)) if v is not None)
    publish(result, command, write_md=write_md, as_json=as_json, lines=lines)


@bench_group.command("fetch")
@click.option("--json", "as_json", is_flag=True)
@click.option("--rate", default="1G", show_default=True, help="--slice-rate and --slice-rate-per-peer of the holders (the default lifts the workers' pacing: the transport is measured).")
@click.option("--probes", default=200, show_default=True, type=click.IntRange(1), help="Idle dispatches timed before the fetch (as many as fit are timed during it).")
@click.option("--rtt-ms", default=80.0, show_default=True, type=click.FloatRange(min=0), help="Also fetch in the real-NAT testbed with the holders this far from the fetcher (root only; 0: loopback only).")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_fetch(as_json: bool, rate: str, probes: int, rtt_ms: float, write_md: str | None) -> None:
    """Slice fetch MB/s from 1 vs 3 holders (loopback and the testbed, real processes) and a holder's dispatch latency meanwhile."""
    from node.bench import fetch

    result = fetch.run(rate, probes, rtt_ms)
    lat = result["dispatch_latency_of_a_holder"]
    where = {"loopback": result["loopback"], **({f"testbed {rtt_ms:g} ms": result["testbed"]} if result["testbed"] else {})}
    lines = [f"{place} {k}: {v['mb']} MB in {v['seconds']} s = {v['mb_s']} MB/s (transfer {v['transfer_mb_s']} MB/s)" for place, runs in where.items() for k, v in runs.items() if k != "rtt_ms"]
    lines += [f"dispatch latency {k}: {v}" for k, v in lat.items()]
    publish(result, f"moeswarm bench fetch --json --rate {rate} --rtt-ms {rtt_ms:g}", write_md=write_md, as_json=as_json, lines=lines)


@bench_group.command("dispatch")
@click.option("--json", "as_json", is_flag=True)
@click.option("--tokens", "n_tokens", default=16, show_default=True, help="Decode steps timed per path.")
@click.option("--qtype", default="Q4_K", show_default=True)
@click.option("--layers", "n_layer", default=1, show_default=True)
@click.option("--experts", "n_expert", default=REFERENCE["n_expert"], show_default=True, help="Fewer for a quick run.")
@click.option("--max-datagram", default=16384, show_default=True, help="QUIC datagram size on both ends (loopback takes 16384).")
@click.option("--rounds", default=3, show_default=True, help="Alternating local/remote rounds; medians are reported.")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_dispatch(as_json: bool, n_tokens: int, qtype: str, n_layer: int, n_expert: int, max_datagram: int, rounds: int, write_md: str | None) -> None:
    """Loopback decode throughput, remote (1 worker process over QUIC) vs all-local, and exact message bytes."""
    from node.bench import dispatch

    result = dispatch.run(n_tokens, qtype, n_layer, n_expert, max_datagram, rounds)
    t, lg, sc = result["throughput"], result["ledger"], result["spot_check"]
    lines = [f"{k}: out {v['out']:.0f} B, back {v['back']:.0f} B, total {v['total']:.0f} B" for k, v in result["bytes_per_token_per_layer"].items()]
    lines += [f"decode: local {t['local_tokens_s']} tokens/s, remote {t['remote_tokens_s']} tokens/s, ratio {t['ratio']}; identical {result['identical']}",
              f"ledgers: remote {lg['remote_tokens_s_without']} tokens/s without, {lg['remote_tokens_s_with']} with ({lg['cost_pct']}% cost)",
              f"spot checks at {sc['rate']}: remote {sc['remote_tokens_s_without']} tokens/s without, {sc['remote_tokens_s_with']} with ({sc['cost_pct']}% cost, {sc['checked']} checked)"]  # fmt: skip
    publish(result, "moeswarm bench dispatch --json", write_md=write_md, as_json=as_json, lines=lines)


def swarm_model(model_path: str | None, n_layer: int | None, default_layers: int) -> Path:
    """--model, or the cached random model of `bench swarm` with --layers (default *default_layers*) layers."""
    from node.bench import swarm

    if model_path and n_layer is not None:
        raise click.UsageError("--layers shapes the default random model; a --model file has its own layers")
    return Path(model_path) if model_path else swarm.cached_model(n_layer or default_layers)


@bench_group.command("swarm")
@click.option("--json", "as_json", is_flag=True)
@click.option("--model", "model_path", type=click.Path(dir_okay=False, exists=True), default=None, help="GGUF model (default: a random qwen3moe, hidden 1024, 64 experts top-8, FFN 512, Q4_K, cached under $MOESWARM_HOME/models).")
@click.option("--workers", "n_workers", default=2, show_default=True, type=click.IntRange(1), help="Worker processes; each holds an equal share of every layer's experts.")
@click.option("--layers", "n_layer", default=None, type=click.IntRange(1), help="Layers of the default random model (12 unless given; not with --model).")
@click.option("--tokens", "n_tokens", default=16, show_default=True, type=click.IntRange(1), help="Decode steps timed per path per round.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1), help="Alternating local/swarm rounds; medians are reported.")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_swarm(as_json: bool, model_path: str | None, n_workers: int, n_layer: int | None, n_tokens: int, rounds: int, write_md: str | None) -> None:
    """A local swarm of real processes (the demo's) vs the same model decoding alone: tokens/s, identical output, where a dispatch's time goes."""
    from node.bench import swarm

    r = swarm.run(swarm_model(model_path, n_layer, 12), n_workers, n_tokens, rounds)
    d = r["decode"]
    lines = [f"{r['moe_layers']} MoE layers, {n_workers} workers: local {d['local_tps']} tokens/s, swarm {d['swarm_tps']} tokens/s, ratio {d['ratio']}; identical {r['identical']}",
             f"per dispatch p50: round trip {r['rtt_ms_p50']} ms, worker {r['worker_ms_p50']} ms, overhead {r['overhead_ms_p50']} ms; load {r['load']['start'][0]} -> {r['load']['end'][0]}"]  # fmt: skip
    command = f"moeswarm bench swarm --json --workers {n_workers} --tokens {n_tokens} --rounds {rounds}" + (f" --model {model_path}" if model_path else f" --layers {n_layer or 12}")
    publish(r, command, write_md=write_md, as_json=as_json, lines=lines)
    if not r["identical"]:
        raise SystemExit(1)

@bench_group.command("federation")
@click.option("--json", "as_json", is_flag=True)
@click.option("--model", "model_path", type=click.Path(dir_okay=False, exists=True), default=None, help="GGUF model (default: bench swarm's random model, cached under $MOESWARM_HOME/models).")
@click.option("--workers", "n_workers", default=2, show_default=True, type=click.IntRange(1), help="Worker processes in the shared pool; each holds an equal share of every layer's experts.")
@click.option("--layers", "n_layer", default=None, type=click.IntRange(1), help="Layers of the default random model (4 unless given; not with --model).")
@click.option("--backbones", "counts", default="1,2,4", show_default=True, help="Comma-separated counts of backbones decoding at once.")
@click.option("--tokens", "n_tokens", default=16, show_default=True, type=click.IntRange(1), help="Completion tokens per request.")
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(1), help="Rounds over every count, alternating; medians are reported.")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_federation(as_json: bool, model_path: str | None, n_workers: int, n_layer: int | None, counts: str, n_tokens: int, rounds: int, write_md: str | None) -> None:
    """Several backbones (gateways, real processes) decoding at once against one pool of workers: aggregate and per-backbone tokens/s, Jain's fairness, failures, identical output."""
    from node.bench import federation

    try:
        parsed = tuple(int(c) for c in counts.split(","))
    except ValueError:
        raise click.BadParameter(f"expected counts like 1,2,4; got {counts!r}", param_hint="--backbones") from None
    r = federation.run(swarm_model(model_path, n_layer, 4), n_workers, parsed, n_tokens, rounds)
    lines = [f"{n} backbones: aggregate {v['aggregate_tps']} tokens/s, per backbone {v['per_backbone_tps']}, Jain {v['jain']}, failed {v['failed']}, identical {v['identical']}" for n, v in r["backbones"].items()]
    lines.append(f"worker refusals {r['worker_refusals']}, failed dispatches {r['failed_dispatches']}; load {r['load']['start'][0]} -> {r['load']['end'][0]}")
    command = f"moeswarm bench federation --json --workers {n_workers} --backbones {counts} --tokens {n_tokens} --rounds {rounds}" + (f" --model {model_path}" if model_path else f" --layers {n_layer or 4}")
    publish(r, command, write_md=write_md, as_json=as_json, lines=lines)
    if not r["identical"] or r["failed"]:
        raise SystemExit(1)


@bench_group.command("dht")
@click.option("--json", "as_json", is_flag=True)
@click.option("--nodes", "n_nodes", default=200, show_default=True, type=click.IntRange(4), help="Real py-libp2p DHT nodes on loopback.")
@click.option("--procs", default=8, show_default=True, type=click.IntRange(1), help="Processes sharing the nodes (one trio thread per node).")
@click.option("--layers", default=8, show_default=True, type=click.IntRange(1), help="Layers the nodes' records cover (nodes / layers announcers each).")
@click.option("--lookups", default=200, show_default=True, type=click.IntRange(1), help="Lookups per phase, from random nodes.")
@click.option("--churn", default=0.2, show_default=True, type=click.FloatRange(0, 0.9), help="Fraction of nodes killed (no withdraw) between the phases.")
@click.option("--upkeep", default=600.0, show_default=True, type=click.FloatRange(10), help="Seconds: records' TTL (re-announced after half) and between routing-table refreshes.")
@click.option("--in-flight", default=2, show_default=True, type=click.IntRange(1), help="Lookups running at once (one per process; a lookup costs its ~100 peers' CPU too).")
@click.option("--lookup-timeout", default=20.0, show_default=True, type=click.FloatRange(1), help="Seconds before a lookup returns what it has fetched (LibP2PDiscovery's default is 10).")
@click.option("--simulate", is_flag=True, help="Our DHT code over a simulated network on a virtual clock (node/bench/dhtsim.py): thousands of nodes; --procs, --churn, --in-flight and --lookup-timeout do not apply.")
@click.option("--churn-per-hour", default=0.2, show_default=True, type=click.FloatRange(0, 5), help="--simulate: departures per node per hour, each replaced by a newcomer.")
@click.option("--nat", default=0.3, show_default=True, type=click.FloatRange(0, 0.95), help="--simulate: share of nodes in client mode (NAT-bound).")
@click.option("--rtt-ms", default=80.0, show_default=True, type=click.FloatRange(0.1), help="--simulate: median round trip.")
@click.option("--seed", default=0, show_default=True, help="--simulate: random seed.")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_dht(as_json: bool, n_nodes: int, procs: int, layers: int, lookups: int, churn: float, upkeep: float, in_flight: int, lookup_timeout: float, simulate: bool, churn_per_hour: float, nat: float, rtt_ms: float, seed: int, write_md: str | None) -> None:
    """Lookup hops vs log2 N, latency percentiles and the fraction of live hosts found, before and after churn."""
    from node.bench import dht

    if simulate:
        from node.bench import dhtsim

        opts = dhtsim.Options(nodes=n_nodes, layers=layers, lookups=lookups, ttl=upkeep, churn_per_hour=churn_per_hour, nat=nat, rtt_ms=rtt_ms, seed=seed)
        result = dhtsim.run(opts)
        lines = [f"{n_nodes} simulated nodes (log2 N = {result['log2_nodes']}), {result['hosts']} hosts, upkeep {result['messages_per_node_hour']} messages per node per hour"]
        for phase in ("before_churn", "under_churn"):
            r = result[phase]
            lines.append(f"{phase}: rounds median {r['rounds']['median']} (p90 {r['rounds']['p90']}), found {r['found_fraction']['mean']:.1%} of live hosts (all in {r['found_fraction']['all_found']:.1%} of lookups), {r['messages_per_lookup']} messages per lookup")
        publish(result, f"moeswarm bench dht --simulate --json --nodes {n_nodes} --layers {layers} --lookups {lookups} --churn-per-hour {churn_per_hour:g} --nat {nat:g} --rtt-ms {rtt_ms:g} --seed {seed}", write_md=write_md, as_json=as_json, lines=lines)
        return

    result = dht.run(n_nodes, procs, layers, lookups, churn, ttl=upkeep, in_flight=in_flight, lookup_timeout=lookup_timeout)
    lines = [f"{n_nodes} nodes (log2 N = {result['log2_nodes']}), started in {result['start_s']} s, upkeep every {result['upkeep_s']:g} s, {in_flight} lookups in flight"]
    for phase in ("before_churn", "after_churn"):
        r = result[phase]
        lines.append(f"{phase}: hops median {r['hops']['median']} (p90 {r['hops']['p90']}), latency p50/p90/p99 {r['latency_ms']['p50']}/{r['latency_ms']['p90']}/{r['latency_ms']['p99']} ms, "
                     f"found {r['found_fraction']['mean']:.1%} of live hosts (all of them in {r['found_fraction']['all_found']:.1%} of lookups), dead named {r['dead_hosts_named']}, timed out {r['timed_out']}")  # fmt: skip
    publish(result, f"moeswarm bench dht --json --nodes {n_nodes} --procs {procs} --churn {churn} --upkeep {upkeep:g} --in-flight {in_flight} --lookup-timeout {lookup_timeout:g}", write_md=write_md, as_json=as_json, lines=lines)


@bench_group.command("soak")
@click.option("--json", "as_json", is_flag=True)
@click.option("--minutes", default=30.0, show_default=True, type=click.FloatRange(0.1))
@click.option("--churn-every", default=5.0, show_default=True, type=click.FloatRange(0.5), help="Seconds between stopping one worker (SIGKILL and SIGTERM alternately).")
@click.option("--down", "down_s", default=10.0, show_default=True, type=click.FloatRange(0), help="Seconds a stopped worker stays away.")
@click.option("--relay-every", default=120.0, show_default=True, type=click.FloatRange(1), help="Seconds between relay restarts.")
@click.option("--max-requests", default=100_000, show_default=True, type=click.IntRange(1), help="Per session, a bound besides the time.")
@click.option("--seed", default=0, show_default=True)
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_soak(as_json: bool, minutes: float, churn_every: float, down_s: float, relay_every: float, max_requests: int, seed: int, write_md: str | None) -> None:
    """A gateway with 8 greedy sessions while workers leave and rejoin and the relay restarts: lost/wrong tokens, p99."""
    from node.bench import soak

    r = soak.run(minutes, churn_every, down_s, relay_every, max_requests, seed)
    lines = [f"{r['minutes']} min, {r['sessions']} sessions: {r['requests_ok']} requests ({r['tokens']} tokens), {r['wrong_answers']} wrong, {r['failed_requests']} failed",
             f"request latency p50/p90/p99 {r['request_latency_ms']['p50']}/{r['request_latency_ms']['p90']}/{r['request_latency_ms']['p99']} ms; per token p50/p99 {r['per_token_ms']['p50']}/{r['per_token_ms']['p99']} ms",
             f"churn: {r['churn']}"]  # fmt: skip
    publish(r, f"moeswarm bench soak --json --minutes {minutes:g} --churn-every {churn_every:g} --relay-every {relay_every:g}", write_md=write_md, as_json=as_json, lines=lines)


@bench_group.command("wan")
@click.option("--json", "as_json", is_flag=True)
@click.option("--rtt-ms", "rtts", default="0,20,80", show_default=True, help="Comma-separated RTTs between the backbone and the workers.")
@click.option("--tokens", "n_tokens", default=32, show_default=True, help="Tokens per decoding run.")
@click.option("--prompts", "n_prompts", default=3, show_default=True, type=click.IntRange(1), help="Prompts per variant (tokens/s is over all of them).")
@click.option("--session-tokens", default=24, show_default=True, help="Tokens per gateway request in the sessions check.")
@click.option("--session-rounds", default=3, show_default=True, type=click.IntRange(1), help="Requests each of the 8 concurrent sessions sends back to back.")
@click.option("--star-tokens", default=16, show_default=True)
@click.option("--plots", "plot_dir", type=click.Path(file_okay=False), default=None, help="Write PNG plots into this directory.")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_wan(as_json: bool, rtts: str, n_tokens: int, n_prompts: int, session_tokens: int, session_rounds: int, star_tokens: int, plot_dir: str | None, write_md: str | None) -> None:
    """Tokens/s vs RTT per technique, 8 sessions vs 1, parallel-star layer time (embedded model, testbed; root only)."""
    from node.bench import wan

    try:
        rtt_list = sorted(float(x) for x in rtts.split(","))
    except ValueError:
        raise click.BadParameter(f"{rtts!r}: expected comma-separated numbers of ms, e.g. 0,20,80", param_hint="--rtt-ms") from None
    with progress.bars(progress.wanted(as_json=as_json)) as shown:
        result = wan.run(rtt_list, n_tokens, n_prompts, session_tokens, session_rounds, star_tokens, Path(plot_dir) if plot_dir else None, progress=progress.stage(shown, "benchmark steps"))
    by_rtt = result["by_rtt"]
    command = (f"moeswarm bench wan --json --rtt-ms {rtts} --tokens {n_tokens} --prompts {n_prompts} --session-tokens {session_tokens} "
               f"--session-rounds {session_rounds} --star-tokens {star_tokens}" + (f" --plots {plot_dir}" if plot_dir else ""))  # fmt: skip
    s = result["star"]
    lines = [f"RTT {r['rtt_ms']:g} ms: " + ", ".join(f"{k} {v} tokens/s" for k, v in r["tokens_s"].items()) + f" (bound {r['bound_tokens_s']})" for r in by_rtt]
    lines.append(f"8 sessions: {result['sessions8_aggregate_ratio']}x one session; star layer {s['layer_ms']} ms vs max RTT {s['max_rtt_ms']} ms ({s['ratio']}x)")
    publish(result, command, write_md=write_md, as_json=as_json, lines=lines)


@bench_group.command("drafters")
@click.option("--json", "as_json", is_flag=True)
@click.option("--rtt-ms", default=80.0, show_default=True, type=click.FloatRange(min=0), help="RTT between the backbone and the worker in the testbed (root); 0: local runs only.")
@click.option("--tokens", "n_tokens", default=32, show_default=True, help="Tokens per decoding run.")
@click.option("--prompts", "n_prompts", default=3, show_default=True, type=click.IntRange(1, 3), help="Prompts per variant.")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_drafters(as_json: bool, rtt_ms: float, n_tokens: int, n_prompts: int, write_md: str | None) -> None:
    """Accepted tokens per verify pass and tokens/s: MTP vs n-gram drafts on random glm4moe models, locally and over the testbed WAN."""
    from node.bench import drafters

    with progress.bars(progress.wanted(as_json=as_json)) as shown:
        result = drafters.run(rtt_ms, n_tokens, n_prompts, progress=progress.stage(shown, "benchmark steps"))
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    lines = [f"{kind} {where}: " + ", ".join(f"{name} {v['tokens_s']} tokens/s" + (f" ({v['accepted_per_verify_pass']} accepted/pass)" if "accepted_per_verify_pass" in v else "") for name, v in r.items())
             for kind in ("random", "restating") for where, r in result[kind].items()]  # fmt: skip
    publish(result, f"moeswarm bench drafters --json --rtt-ms {rtt_ms:g} --tokens {n_tokens} --prompts {n_prompts}", write_md=write_md, as_json=as_json, lines=lines)


@bench_group.command("paths")
@click.option("--json", "as_json", is_flag=True)
@click.option("--rtt-ms", default=80.0, show_default=True, help="WAN round trip between the backbone and workers (and between punching peers).")
@click.option("--attempts", default=20, show_default=True, help="Punch attempts per pair.")
@click.option("--tokens", "n_tokens", default=16, show_default=True)
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_paths(as_json: bool, rtt_ms: float, attempts: int, n_tokens: int, write_md: str | None) -> None:
    """Punch success (cone<->public, cone<->cone, symmetric), time to upgrade, relay vs direct throughput. Root only."""
    from node.bench import paths

    result = paths.run(rtt_ms, attempts, n_tokens)
    t = result["throughput"]
    lines = [f"punch {k}: {v['ok']}/{v['tries']} direct" for k, v in result["punch"].items()]
    lines.append(f"upgrade median {result['upgrade_ms_median']} ms; direct {t['direct_tokens_s']} tokens/s, relay at the edge {t['relay_tokens_s']} ({t['ratio']}x), "
                 f"relay mid-WAN {result['relay_mid_wan']['throughput']['ratio']}x; failed dispatches {result['failed_dispatches']}")
    publish(result, f"moeswarm bench paths --json --rtt-ms {rtt_ms:g} --attempts {attempts}", write_md=write_md, as_json=as_json, lines=lines)
