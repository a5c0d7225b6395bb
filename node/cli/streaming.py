"""Run a generation on a worker thread and stream its text to the terminal as tokens arrive."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, wait

import click

from experts.forward import Backbone, MoeFfn
from experts.generate import generate
from experts.speculative import SpecStats, default_drafter, speculative_generate
from experts.tokenizer import StreamDecoder, Tokenizer


def serial(hook: MoeFfn) -> MoeFfn:
    """*hook* without latency hiding: wait for the routed sum before the forward computes the shared expert."""

    def waited(layer: int, x, ids, w) -> Future:
        routed = hook(layer, x, ids, w)
        wait([routed])  # done before the forward moves on; it reads the sum where it always does
        return routed

    return waited


async def stream_tokens(bb: Backbone, tok: Tokenizer, prompt: str, n_tokens: int, hook: MoeFfn, *, stream: bool, speculative: bool = False, overlap: bool = True) -> tuple[list[int], float, SpecStats | None]:
    """Generate off the event loop (the MoE hook needs the loop); echo text when *stream*. Returns (tokens, seconds, stats).

    *overlap* False waits for each layer's dispatch before the shared expert (for measuring what the overlap hides)."""
    hook = hook if overlap else serial(hook)
    ids = tok.encode(prompt)
    out: list[int] = []
    dec = StreamDecoder(tok)
    stats = SpecStats() if speculative else None
    if speculative:
        steps = speculative_generate(bb, ids, n_tokens, hook, stop={tok.eos_id}, stats=stats, drafter=default_drafter(bb.model))
    else:
        steps = generate(bb, ids, n_tokens, hook, stop={tok.eos_id})
    if stream:
        click.echo(prompt, nl=False)

    def run() -> None:
        for t, _ in steps:
            out.append(t)
            if stream:
                click.echo(dec.push(t), nl=False)

    t0 = time.perf_counter()
    await asyncio.to_thread(run)
    elapsed = time.perf_counter() - t0
    if stream:
        click.echo(dec.flush())
    return out, elapsed, stats
