"""Model commands: slice, verify, model random."""

from __future__ import annotations

from typing import Any

import click
import gguf

from experts.archs import ARCHS
from experts.codecs import Codec
from experts.delta_net import CHECKPOINT_EVERY
from experts.errors import UsageError
from experts.gguf_model import ExpertRange, GGUFModel
from experts.parts import Part
from experts.random_model import SUPPORTED_QTYPES, random_config, with_settings, write_random_model
from experts.slices import check_slice, parse_range, write_part_slice, write_slice
from node.cli import progress
from node.cli.options import KERNEL_NAMES, kernel_options, open_kernel, parse_size
from node.cli.root import emit_json


@click.command("slice")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--layers", default=None, help="Layer range, e.g. 0-3 (an expert or dense slice).")
@click.option("--experts", "experts_", default=None, help="Expert range, e.g. 0-31 (an expert slice).")
@click.option("--dense", is_flag=True, help="Cut the dense weights of --layers instead (attention, norms, router, shared expert: all but the routed experts), for a stage.")
@click.option("--head", is_flag=True, help="Cut the embeddings, output norm, output head and tokenizer instead, for a client.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
def slice_cmd(model: str, layers: str | None, experts_: str | None, dense: bool, head: bool, output: str) -> None:
    """Write a self-contained slice of MODEL: these layers x these experts, the dense weights of these layers
    (--dense), or the head (--head); each provable against the model's digest."""
    part = Part.HEAD if head else Part.DENSE if dense else Part.EXPERTS
    if dense and head:
        raise UsageError("give one of --dense and --head")
    if (part is Part.HEAD) != (layers is None) or (part is Part.EXPERTS) != (experts_ is not None):
        raise UsageError({Part.EXPERTS: "an expert slice needs --layers and --experts", Part.DENSE: "--dense needs --layers and takes no --experts", Part.HEAD: "--head takes neither --layers nor --experts"}[part])
    m = GGUFModel(model)
    lr = parse_range(layers, m.cfg.n_layer, "layer") if layers is not None else range(0)
    with progress.bars(progress.wanted()) as shown:
        if part is Part.EXPERTS:
            assert experts_ is not None
            er = parse_range(experts_, m.cfg.n_expert, "expert")
            out = write_slice(m, lr, ExpertRange(er.start, er.stop), output, progress_bar=shown is not None)
            what = f"layers {layers}, experts {experts_}"
        else:
            out = write_part_slice(m, part, lr, output, progress_bar=shown is not None)
            what = "the head" if part is Part.HEAD else f"dense weights of layers {layers}"
        sl = GGUFModel(out)
        check_slice(sl, m.digest, progress.stage(shown, "checking the slice"))
    size = out.stat().st_size
    click.echo(f"wrote {out}: {what} of model {m.digest[:16]}... ({size / 1e6:.1f} MB of {m.path.stat().st_size / 1e6:.1f} MB)")


@click.command("verify")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--wire", default="f32", show_default=True, type=click.Choice(["f32", "f16", "int8"]))
@click.option("--reference", type=click.Choice(["llamacpp"]), default=None, help="Also compare with llama.cpp's logits.")
@click.option("--groups", default=3, show_default=True, help="Expert groups (simulated workers) of the remote path.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@kernel_options
def verify_cmd(model: str, wire: str, reference: str | None, groups: int, as_json: bool, kernel_name: str, threads: int | None) -> None:
    """Gate a wire codec for MODEL: remote path vs local path (and vs llama.cpp). Exit 0 only on pass."""
    from experts.verify import run_gate
    from node.verdicts import record_verdict

    codec = Codec.parse(wire)
    with progress.bars(progress.wanted(as_json=as_json)) as shown:
        result = run_gate(GGUFModel(model), codec, kernel=open_kernel(kernel_name, threads), groups=groups, reference=reference, progress=progress.stage(shown, "verifying"))
    record_verdict(result["model_digest"], codec, result["verdict"])
    if as_json:
        emit_json(result)
    else:
        rl = result["remote_vs_local"]
        click.echo(f"model {result['model_digest'][:16]}... wire {wire}: max|diff| {rl['max_abs_diff']:.3g}, min cosine {rl['min_cosine']:.7f}, "
                   f"argmax {rl['argmax_agree']:.3f}, bit-identical {rl['bit_identical']} over {rl['positions']} positions")
        if result["reference"]:
            r = result["reference"]
            click.echo(f"llama.cpp: min cosine {r['min_cosine']:.7f}, argmax {r['argmax_agree']:.3f} ({r['near_ties_excluded']} near ties, {r['route_ties_excluded']} routing near-ties excluded)")
        click.echo(f"verdict: {result['verdict']}")
    raise SystemExit(0 if result["verdict"] == "pass" else 1)




@click.command("inspect")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--layers", default=None, help="Plan for hosting only these layers, e.g. 0-3 (default: all in the file).")
@click.option("--experts", "experts_", default=None, help="Plan for hosting only these experts, e.g. 0-31 (default: all in the file).")
@click.option("--memory-budget", default=None, help="RAM the hosted experts may take, e.g. 512M: shows whether a worker would start, and how.")
@click.option("--kernel", "kernel_name", default="ggml", show_default=True, type=click.Choice(KERNEL_NAMES), help="The worker's kernel: ggml holds packed bytes, reference float32 (or dequantizes on the fly).")
@click.option("--against", type=click.Path(dir_okay=False), help="For a slice: the full model it must have been cut from.")
@click.option("--json", "as_json", is_flag=True)
def inspect_cmd(model: str, layers: str | None, experts_: str | None, memory_budget: str | None, kernel_name: str, against: str | None, as_json: bool) -> None:
    """Show a model's or slice's configuration, digest and the memory its experts take when served.

    Resident bytes are per layer of the hosted part and in total, for the chosen kernel; a budget they
    exceed is refused here exactly as `moeswarm worker --memory-budget` would refuse it.
    """
    from dataclasses import asdict

    from experts.hosting import packed_bytes, plan_load
    from experts.kernels import KERNELS

    m = GGUFModel(model)
    if m.is_slice:
        check_slice(m, GGUFModel(against).digest if against else None)
    elif against:
        raise UsageError(f"{model} is a full model, not a slice; --against only applies to slices")
    if m.kind in (Part.DENSE, Part.HEAD):  # no experts to plan for: what it holds, and whose it is
        what = "the head" if m.kind is Part.HEAD else f"dense weights of layers {m.layers.start}-{m.layers.stop - 1}"
        nbytes = sum(int(t.n_bytes) for t in m.tensors.values())
        if as_json:
            emit_json({"path": str(m.path), "model_digest": m.digest, "slice": True, "kind": str(m.kind), "layers": list(m.layers), "tensors": sorted(m.tensors), "tensor_bytes": nbytes})
        else:
            click.echo(f"{m.path.name}: {m.kind} slice of model {m.digest[:16]}..., {m.cfg.arch}, {what}: {len(m.tensors)} tensors, {nbytes / 1e6:.1f} MB")
            click.echo(f"digest {m.digest}")
        return
    lr = parse_range(layers, m.cfg.n_layer, "layer") if layers else m.layers
    er = parse_range(experts_, m.cfg.n_expert, "expert") if experts_ else None
    hosted = ExpertRange(er.start, er.stop) if er else m.experts
    budget = parse_size(memory_budget) if memory_budget else None
    plan = plan_load(m, KERNELS[kernel_name], budget, lr, hosted)  # a SliceError (one line) if it does not fit
    info: dict[str, Any] = {
        "path": str(m.path),
        "model_digest": m.digest,
        "slice": m.is_slice,
        "layers": f"{m.layers.start}-{m.layers.stop - 1}",
        "moe_layers": list(m.moe_layers),
        "experts": str(m.experts),
        "config": asdict(m.cfg),
        "hosted": {"layers": f"{lr.start}-{lr.stop - 1}", "experts": str(hosted), "kernel": kernel_name},
        "load": asdict(plan),
        "packed_bytes_per_layer": {i: packed_bytes(m, range(i, i + 1), hosted) for i in lr},
        "kv_cache_bytes_per_token_per_layer": 4 * m.cfg.kv_cache_floats,  # float32, as the backbone keeps it
    }
    if m.cfg.indexer_heads:  # deepseek32: each position's lightning-indexer key, cached beside the latent; minimax-m3: MSA's index key (counted above)
        info["indexer_key_bytes_per_token_per_layer"] = 4 * m.cfg.indexer_head_dim
    if m.cfg.layer_kinds:  # gated delta-net layers cache their recurrence's inputs, and state checkpoints
        info["recurrent_layers"] = [i for i in range(m.cfg.n_layer) if m.cfg.is_recurrent(i)]
        info["recurrent_cache_bytes_per_token_per_layer"] = 4 * m.cfg.gdn_row_floats
        info["recurrent_state_bytes"] = 4 * m.cfg.gdn_state_floats
    if as_json:
        emit_json(info)
        return
    kind = "slice of model" if m.is_slice else "model"
    click.echo(f"{m.path.name}: {kind} {m.digest[:16]}..., {m.cfg.arch}, layers {info['layers']}, experts {info['experts']}")
    c = m.cfg
    dense = len(m.layers) - len(m.moe_layers)
    click.echo(f"hidden {c.n_embd}, {c.n_layer} layers ({dense} of these dense, no experts), {c.n_expert} experts top-{c.n_expert_used}, expert FFN {c.n_ff_exp}, shared FFN {c.n_ff_shexp}")
    click.echo(f"KV cache: {info['kv_cache_bytes_per_token_per_layer']} bytes per token per layer ({c.kv_cache_floats} float32" + (", K and V and MSA's index key, on its sparse layers)" if c.indexer_block_size else ", the MLA latent and the lightning indexer's key)" if c.indexer_heads else ", the MLA latent)" if c.kv_lora_rank else ", the widest layer)" if c.n_head_kv_layers else ")"))
    if c.layer_kinds:
        click.echo(
            f"recurrent layers {info['recurrent_layers']}: {info['recurrent_cache_bytes_per_token_per_layer']} bytes per token per layer, "
            f"plus a {info['recurrent_state_bytes']}-byte state checkpoint every {CHECKPOINT_EVERY} positions (KV cache above: the full-attention layers)"
        )
    click.echo(f"hosting layers {info['hosted']['layers']} x experts {hosted} with kernel {kernel_name}: {plan.describe()}")
    click.echo(f"digest {m.digest} (publish it with the model: `moeswarm fetch --model-digest` trusts nothing else)")


@click.group("model")
def model_group() -> None:
    """Model files: generate random models for tests and benchmarks."""


@model_group.command("random")
@click.option("--arch", default="qwen3moe", show_default=True, type=click.Choice(sorted(ARCHS)), help="Every feature llama.cpp implements for the arch is switched on (dense lead, MTP block, partial RoPE, router bias/groups/scale).")
@click.option("--layers", "n_layer", default=2, show_default=True)
@click.option("--hidden", "n_embd", default=64, show_default=True)
@click.option("--heads", "n_head", default=4, show_default=True)
@click.option("--kv-heads", "n_head_kv", default=None, type=int, help="KV heads (default 2; olmoe: as many as heads).")
@click.option("--head-dim", "head_dim", default=None, type=int, help="Attention head width (default hidden / heads; Qwen3-30B-A3B: 128 with hidden 2048, 32 heads).")
@click.option("--experts", "n_expert", default=8, show_default=True)
@click.option("--top-k", "n_expert_used", default=2, show_default=True)
@click.option("--expert-ffn", "n_ff_exp", default=32, show_default=True)
@click.option("--shared-ffn", "n_ff_shexp", default=None, type=int, help="Shared expert width (qwen2moe; default 2x expert FFN).")
@click.option("--mla-kv-b", "mla_kv_b", is_flag=True, help="deepseek2: the legacy attn_kv_b layout instead of attn_k_b/attn_v_b.")
@click.option("--set", "settings", multiple=True, metavar="FIELD=VALUE", help="Set any config field after the shape flags (the names `inspect --json` shows), e.g. --set indexer_top_k=8; repeatable.")
@click.option("--qtype", default="F32", show_default=True, type=click.Choice(sorted(q.name for q in SUPPORTED_QTYPES)))
@click.option("--seed", default=0, show_default=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
def random_cmd(arch: str, output: str, qtype: str, seed: int, settings: tuple[str, ...], **shape: int) -> None:
    """Write a random MoE model of any shape as GGUF (llama.cpp loads it)."""
    cfg = with_settings(random_config(arch, **shape), settings)
    write_random_model(output, cfg, qtype=gguf.GGMLQuantizationType[qtype], seed=seed)
    m = GGUFModel(output)
    click.echo(f"wrote {output}: {arch}, {cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_expert} experts top-{cfg.n_expert_used}, {qtype}, digest {m.digest[:16]}...")


__all__ = ["slice_cmd", "verify_cmd", "random_cmd", "inspect_cmd"]
