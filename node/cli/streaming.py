"""Run a generation on the event loop's thread (``node.backbone.onloop``) and stream its text to the terminal as tokens
arrive."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import click

from experts.forward import Backbone, KVCache, MoeFfn
from experts.generate import generate
from experts.speculative import Drafter, FollowingDrafter, SpecStats, default_drafter, speculative_generate
from experts.tokenizer import StreamDecoder, Tokenizer
from node.backbone import onloop
from node.backbone.provenance import Provenance, Rollback, RollbackStats, exact_generate


def serial(hook: MoeFfn) -> MoeFfn:
    """*hook* without latency hiding: wait for the routed sum before the forward computes the shared expert."""

    def waited(layer: int, x, ids, w) -> Future:
        routed = hook(layer, x, ids, w)
        routed.result()  # done before the forward moves on; it reads the sum where it always does (on the loop too)
        return routed

    return waited


async def stream_tokens(bb: Backbone, tok: Tokenizer, prompt: str, n_tokens: int, hook: Callable[..., Future], *, stream: bool, speculative: bool = False, drafter: Drafter | FollowingDrafter | None = None, overlap: bool = True, culprits: Sequence[str] | None = None, settle: Callable[[], None] | None = None, cache: KVCache | None = None, off_loop: bool = False) -> tuple[list[int], float, SpecStats | None, RollbackStats | None]:
    """Generate on the event loop's thread, the MoE hook's dispatches awaited there; echo text when *stream*. Returns (tokens, seconds, stats, rollbacks).

    *drafter* proposes the speculative drafts (default: the model's n-gram table or prompt lookup).
    *overlap* False waits for each layer's dispatch before the shared expert (for measuring what the overlap hides).
    *culprits* (``RemoteMoE.checker.culprits``; *hook* then is ``RemoteMoE.hook``): roll back and re-decode when a spot
    check catches a worker whose unchecked sums were used (:mod:`node.backbone.provenance`); the streamed text is
    then retracted on the terminal (a notice on stderr, the kept text again) and the returned tokens are exact.
    *settle* (``RemoteMoE.settle_blocking``): the last check waits for the receipts' batch signatures (see Provenance).
    *cache*: the sequence's starting cache (a staged backbone's ``new_cache``); *off_loop*: generate on a thread, for
    a forward that waits on the loop itself (a stage chain's links block on their round trips)."""
    ids = tok.encode(prompt)
    out: list[int] = []
    stats = SpecStats() if speculative else None
    decode = functools.partial(speculative_generate, stats=stats, drafter=drafter or default_drafter(bb.model)) if speculative else generate
    rollbacks: RollbackStats | None = None
    steps: Iterator
    if culprits is None:
        steps = decode(bb, ids, n_tokens, hook if overlap else serial(hook), stop={tok.eos_id}, cache=cache)
    else:
        rollbacks, provenance = RollbackStats(), Provenance(culprits, settle)
        moe_ffn = functools.partial(hook, provenance=provenance)
        steps = exact_generate(bb, ids, n_tokens, moe_ffn if overlap else serial(moe_ffn), provenance, decode=decode, stop={tok.eos_id}, stats=rollbacks)
    if stream:
        click.echo(prompt, nl=False)

    def run() -> None:
        dec = StreamDecoder(tok)
        for step in steps:
            if isinstance(step, Rollback):
                del out[step.keep :]
                if stream:
                    click.echo(f"\n[a spot check caught a worker: text after token {step.keep} retracted, decoding it again]", err=True)
                    dec = StreamDecoder(tok)
                    click.echo(prompt + "".join(dec.push(t) for t in out), nl=False)
                continue
            out.append(step[0])
            if stream:
                click.echo(dec.push(step[0]), nl=False)
        if stream:
            click.echo(dec.flush())

    t0 = time.perf_counter()
    if off_loop:
        await asyncio.to_thread(run)
    else:
        await onloop.run_on_loop(run)  # one sequence: the forward on the loop's thread, no thread hop per MoE layer
    elapsed = time.perf_counter() - t0
    return out, elapsed, stats, rollbacks
