"""Train moeswarm's embedded qwen2moe model on the KJV excerpt and export it as GGUF.

    pip install -e '.[train]'
    python training/train_embedded.py --steps 1200 --seed 0 --threads 1

Reads only ``training/corpus/kjv.txt``; writes ``experts/data/embedded.gguf``
through :func:`experts.model_writer.write_model`. See ``training/README.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

# OpenMP threads spin at barriers by default: on a busy 2-core machine a preempted
# thread then stalls every op. Measured with another process on one core: 2 threads
# 6.3 s/step spinning, 0.74 passive; 1 thread 0.57 (2 threads on an idle machine: 0.36).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bpe import tokenizer_spec, train_bpe  # noqa: E402
from embedded_model import Qwen2MoeLM  # noqa: E402
from experts.config import ModelConfig  # noqa: E402
from experts.model_writer import expected_shapes, write_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "training" / "corpus" / "kjv.txt"
DEFAULT_OUT = ROOT / "experts" / "data" / "embedded.gguf"
VOCAB_SIZE = 1024
VAL_EVERY_NTH_VERSE = 50  # verses 0, 50, 100, ... are held out
PROMPT = "And God said"


def model_config(n_vocab: int) -> ModelConfig:
    return ModelConfig(
        arch="qwen2moe",
        n_vocab=n_vocab,
        n_embd=128,
        n_layer=4,
        n_head=4,
        n_head_kv=2,
        head_dim=32,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=64,
        n_ff_shexp=128,
        rms_eps=1e-6,
        rope_theta=10000.0,
        context_length=512,
        name="moeswarm-embedded-kjv",
    )


class Stream:
    """Token ids of many verses back to back, with the offset where each verse starts."""

    def __init__(self, verses: list[list[int]]) -> None:
        self.ids = torch.tensor([i for v in verses for i in v], dtype=torch.long)
        self.starts = np.cumsum([0] + [len(v) for v in verses[:-1]])

    def batch(self, rng: random.Random, batch: int, seq: int, bos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (batch, seq).

        Half the windows start anywhere, the rest at a verse start, some of those
        after ``<|endoftext|>`` so a prompt works with or without a BOS token.
        """
        rows = []
        limit = len(self.ids) - seq - 1
        for _ in range(batch):
            r = rng.random()
            if r < 0.5:
                rows.append(self.ids[rng.randrange(limit) :][: seq + 1])
                continue
            start = int(self.starts[rng.randrange(len(self.starts))])
            start = min(start, limit)
            window = self.ids[start:][: seq + 1]
            if r > 0.85:
                window = torch.cat((torch.tensor([bos]), window[:seq]))
            rows.append(window)
        x = torch.stack(rows)
        return x[:, :-1], x[:, 1:]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: Qwen2MoeLM, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW; weight decay only on matrices (not norms, biases or the shared-expert gate vector)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def evaluate(model: Qwen2MoeLM, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    losses = []
    for x, y in batches:
        logits, _ = model(x)
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def expert_usage(model: Qwen2MoeLM, x: torch.Tensor) -> list[int]:
    """Per layer, how many experts receive at least one token of *x* (a health check for routing)."""
    model.eval()
    model(x)
    model.train()
    return [int((block.last_counts > 0).sum()) for block in model.blocks]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--threads", type=int, default=1, help="torch threads; 1 is steadiest on a shared machine")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.1, help="residual dropout while training")
    p.add_argument("--aux-coef", type=float, default=0.01, help="weight of the load-balancing loss")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    verses = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    tok = train_bpe(verses, VOCAB_SIZE)
    spec = tokenizer_spec(tok)
    bos = spec.bos_id
    encoded = [e.ids for e in tok.encode_batch(verses)]
    train = Stream([v for i, v in enumerate(encoded) if i % VAL_EVERY_NTH_VERSE])
    val = Stream([v for i, v in enumerate(encoded) if not i % VAL_EVERY_NTH_VERSE])
    val_rng = random.Random(12345)
    val_batches = [val.batch(val_rng, args.batch, args.seq, bos) for _ in range(4)]

    cfg = model_config(len(spec.tokens))
    model = Qwen2MoeLM(cfg, dropout=args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    active = n_params - cfg.n_layer * (cfg.n_expert - cfg.n_expert_used) * 3 * cfg.n_ff_exp * cfg.n_embd
    print(f"config {cfg}", flush=True)
    print(
        f"params {n_params:,} (active per token {active:,}); train tokens {len(train.ids):,}, "
        f"val tokens {len(val.ids):,}; vocab {cfg.n_vocab}, merges {len(spec.merges)}",
        flush=True,
    )
    opt = make_optimizer(model, args.lr, args.weight_decay)

    best_val, best_step, best_state = math.inf, 0, None
    t0 = time.monotonic()
    window_loss = window_aux = 0.0
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = train.batch(rng, args.batch, args.seq, bos)
        logits, aux = model(x)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        (ce + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window_loss += ce.item()
        window_aux += aux.item()
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            n = args.log_every if done % args.log_every == 0 else done % args.log_every
            elapsed = time.monotonic() - t0
            print(
                f"step {done:5d}/{args.steps} loss {window_loss / n:.4f} aux {window_aux / n:.4f} "
                f"lr {lr:.2e} elapsed {elapsed:7.1f}s ({elapsed / done:.2f}s/step)",
                flush=True,
            )
            window_loss = window_aux = 0.0
        if done % args.eval_every == 0 or done == args.steps:
            val_loss = evaluate(model, val_batches)
            print(
                f"eval step {done} val_loss {val_loss:.4f} "
                f"experts_used_per_layer {expert_usage(model, val_batches[0][0])}",
                flush=True,
            )
            if val_loss < best_val:
                best_val, best_step = val_loss, done
                best_state = {k: v.clone() for k, v in model.state_dict().items()}
    print(f"training took {time.monotonic() - t0:.0f}s", flush=True)

    # Export the weights with the best held-out loss: a 3.8M-parameter model overfits 0.4M tokens.
    model.load_state_dict(best_state)
    model.eval()
    print(f"exporting step {best_step} (val_loss {best_val:.4f})", flush=True)
    arrays = model.export_arrays()
    expected = expected_shapes(cfg)
    wrong = sorted(n for n in set(arrays) | set(expected) if n not in arrays or arrays[n].shape != expected.get(n))
    if wrong:
        raise SystemExit(f"tensors missing, extra or misshaped against expected_shapes(): {wrong}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_model(args.out, cfg, arrays, spec)
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)", flush=True)

    prompt = tok.encode(PROMPT).ids
    sample = tok.decode(model.greedy(prompt, 80))
    print(f"greedy sample: {sample!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
