"""`--stages auto` for the backbone commands (issue 26): a client that chains the stages announced on the DHT.

The options are declared here once, and :func:`generate_staged` is `backbone generate`'s staged path: it returns None
when no chain covers the model, and the command goes on with per-layer dispatch (today's path)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from concurrent.futures import Future

import click
import structlog

from experts.errors import LocalProtocolError, UsageError
from experts.gguf_model import GGUFModel
from experts.kernels import Kernel
from experts.speculative import pick_drafter
from experts.stage_forward import StageChain, StagedBackbone
from experts.tokenizer import Tokenizer
from node.backbone.options import BackboneOptions
from node.cli.streaming import stream_tokens
from node.stage.chooser import NoChain, estimated_ms
from node.stage.client import stage_planner
from p2p.identity import Identity

log = structlog.get_logger("node.cli.staged")
STAGES = ("off", "auto")


def stages_options(command):
    """``--stages``, ``--stages-wait`` and ``--stage-timeout``, for the backbone commands that can chain stages."""
    command = click.option("--stage-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="With --stages auto: seconds a pass may take at one stage before it counts as lost (then another stage of the same layers takes over).")(command)
    command = click.option("--stages-wait", default=10.0, show_default=True, type=click.FloatRange(min=0), help="With --stages auto: seconds to wait for stage records covering every layer before falling back to per-layer dispatch.")(command)
    return click.option("--stages", default="off", show_default=True, type=click.Choice(STAGES), help="auto: chain the stages announced on the DHT (the lowest-latency chain covering every layer), keeping only the embeddings, head and tokenizer here; per-layer dispatch where no chain covers the model.")(command)


def _no_experts(layer: int, x, ids, w) -> Future:
    raise LocalProtocolError("a staged client computes no experts: its stages run every layer")


async def generate_staged(identity: Identity, model: GGUFModel, bootstrap: Sequence[str], kernel: Kernel, session: BackboneOptions, tok: Tokenizer, prompt: str, n_tokens: int, *, stream: bool, speculative: bool, drafter: str, wait_s: float, hop_timeout: float) -> dict | None:
    """Generate through the best chain of announced stages; None (after one log line) when no chain covers the model.

    The client holds the embeddings, output head and tokenizer; speculative drafts are verified in one pass through
    the chain, each stage cutting its KV cache back where a draft was rejected (``StageRunner.pass_hidden``)."""
    if speculative and drafter == "mtp":
        raise UsageError("--drafter mtp runs the model's MTP block beside the trunk: with --stages auto use --drafter ngram")
    async with stage_planner(identity, model, bootstrap, session) as planner:
        planner.hop_timeout = hop_timeout
        try:
            chosen = await planner.chain(wait_s)
        except NoChain as exc:
            log.warning("backbone.stages_fallback", reason=str(exc), fallback="per-layer dispatch")
            return None
        chain = StageChain([planner.link(c) for c in chosen], planner.replace)
        staged = StagedBackbone(model, chain, kernel)
        drafts = pick_drafter(staged, drafter) if speculative else None
        out, elapsed, spec, _ = await stream_tokens(staged, tok, prompt, n_tokens, _no_experts, stream=stream, speculative=speculative, drafter=drafts, cache=staged.new_cache(secrets.token_hex(8)), off_loop=True)
        stages = [{"peer": c.peer, "layers": c.span, "rtt_ms": round(c.rtt_ms, 3), "price": c.price} for c in chosen]
        extra = {"speculative": {**spec.summary(), "drafter": drafter}} if spec else {}
        return {"tokens": len(out), "text": tok.decode(out), "token_ids": out, "tokens_per_s": round(len(out) / elapsed, 3), "stages": stages, "estimated_ms": round(estimated_ms(chosen, planner.hop_ms), 3), "replays": chain.replays, **extra}
