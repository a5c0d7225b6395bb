"""`moeswarm demo`: generate text from the embedded model with its experts split into groups.

At this stage the groups run in this process and every group's traffic crosses the
wire codec (encode -> bytes -> decode), as it will between real processes; the run
is checked against the plain local forward.
"""

from __future__ import annotations

import time

import click

from experts.codecs import Codec
from experts.embedded import DEFAULT_PROMPT, EMBEDDED_MODEL
from experts.forward import Backbone
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.slices import ExpertStore
from experts.tokenizer import StreamDecoder, Tokenizer
from experts.verify import wire_moe

from .cli import emit_json, main


@main.command("demo")
@click.option("--model", "model_path", default=str(EMBEDDED_MODEL), show_default=False, help="GGUF model (default: the embedded one).")
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True)
@click.option("--tokens", "n_tokens", default=32, show_default=True)
@click.option("--workers", default=3, show_default=True, help="Expert groups the model is split into.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary instead of streaming text.")
def demo_cmd(model_path: str, prompt: str, n_tokens: int, workers: int, as_json: bool) -> None:
    """Generate text from the embedded model with its experts split across groups; check it equals the local run."""
    model = GGUFModel(model_path)
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    bb = Backbone(model)
    store = ExpertStore(model)
    part = Partition.even(model.cfg.n_expert, workers)
    ids = tok.encode(prompt)
    stop = {tok.eos_id}

    if not as_json:
        click.echo(f"model {model.path.name} ({model.cfg.arch}, {model.cfg.n_layer} MoE layers, {model.cfg.n_expert} experts, top-{model.cfg.n_expert_used}), "
                   f"digest {model.digest[:16]}...; experts split into {len(part.bounds)} groups {[f'{a}-{b - 1}' for a, b in part.bounds]}")
        click.echo(prompt, nl=False)
    stream = StreamDecoder(tok)
    out: list[int] = []
    t0 = time.perf_counter()
    for t, _ in generate(bb, ids, n_tokens, wire_moe(store, part, Codec.F32), stop=stop):
        out.append(t)
        if not as_json:
            click.echo(stream.push(t), nl=False)
    elapsed = time.perf_counter() - t0
    if not as_json:
        click.echo(stream.flush())
    local = [t for t, _ in generate(bb, ids, n_tokens, lambda i, x, e, w: grouped_moe(store, part, i, x, e, w), stop=stop)]
    summary = {
        "model": str(model.path),
        "model_digest": model.digest,
        "prompt": prompt,
        "tokens": len(out),
        "text": tok.decode(out),
        "identical_to_local": out == local,
        "groups": [f"{a}-{b - 1}" for a, b in part.bounds],
        "tokens_per_s": round(len(out) / elapsed, 2) if elapsed > 0 else None,
        "workers": [],
        "ledger_paths": [],
    }
    if as_json:
        emit_json(summary)
    else:
        click.echo(f"{len(out)} tokens in {elapsed:.2f} s ({summary['tokens_per_s']} tokens/s); identical to the single-process run: {summary['identical_to_local']}")
    if not summary["identical_to_local"]:
        raise SystemExit(1)


__all__ = ["demo_cmd"]
