"""Build the embedded model's n-gram draft table, experts/data/embedded.ngram.npz.

    python training/build_ngram.py            # ~12 min on one core

Speculative decoding with :class:`experts.speculative.NgramDrafter` drafts what this
table says follows the last 1..8 tokens. The table is a model of the model, not of
the Bible: the embedded model was stopped at its best held-out loss, so it does not
recite its corpus, and a table of what the text says next predicted its greedy
continuations worse (measured, see training/README.md). It counts, per context:

1. along the corpus (``training/corpus/kjv.txt``, tokenized with the model's own
   tokenizer from the GGUF), the model's greedy choice at each position, the model
   reading the text in 128-token windows, the length it was trained on;
2. along the model's own greedy continuations (100 tokens) of 2000 verse openings
   drawn at random: once it strays from the text, it falls into habitual phrases
   and loops, and those it repeats whatever the prompt.

Deterministic: the same model file and arguments give the same table, byte for byte.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, KVCache, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import ungrouped_moe
from experts.slices import ExpertStore
from experts.speculative import NgramDrafter, ngram_path
from experts.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "training" / "corpus" / "kjv.txt"
WINDOW = 128  # the training sequence length: the model was never trained on later positions


def model_choices(backbone: Backbone, moe_ffn, ids: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """follow[i]: the model's greedy token after ids[: i + 1], reading ids in windows of *window* tokens."""
    follow = np.empty(len(ids) - 1, np.int64)
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        logits = backbone.forward(chunk.tolist(), KVCache(), moe_ffn)
        n = min(len(chunk), len(follow) - start)
        follow[start : start + n] = np.argmax(logits[:n], axis=1)
    return follow


def opening_prompts(verses: list[str], n: int, seed: int) -> list[str]:
    """*n* distinct openings of 2..6 words of verses drawn at random (seeded)."""
    rng, prompts = random.Random(seed), {}
    while len(prompts) < n:
        words = rng.choice(verses).split()
        prompts.setdefault(" ".join(words[: rng.randint(2, 6)]), None)
    return list(prompts)


def continuations(backbone: Backbone, moe_ffn, tok: Tokenizer, prompts: list[str], n_tokens: int) -> list[np.ndarray]:
    """Each prompt's tokens followed by the model's greedy continuation of up to *n_tokens*."""
    out = []
    for text in prompts:
        prompt = tok.encode(text)
        out.append(np.array(prompt + [t for t, _ in generate(backbone, prompt, n_tokens, moe_ffn, stop={tok.eos_id})], np.int64))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=EMBEDDED_MODEL)
    p.add_argument("--out", type=Path, help="default: beside the model, <name>.ngram.npz")
    p.add_argument("--max-order", type=int, default=8, help="longest context, in tokens")
    p.add_argument("--min-count", type=int, default=1, help="keep a context only if its top follower was seen this often")
    p.add_argument("--continuations", type=int, default=2000, help="greedy continuations of verse openings to count")
    p.add_argument("--continuation-tokens", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="picks the verse openings")
    args = p.parse_args(argv)
    out = args.out or ngram_path(args.model)

    t0 = time.monotonic()
    model = GGUFModel(args.model)
    backbone, store = Backbone(model), ExpertStore(model)
    tok = Tokenizer.from_spec(model.tokenizer_spec)

    moe_ffn = local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))

    verses = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    ids = np.array([t for v in verses for t in tok.encode(v)], np.int64)
    print(f"corpus: {len(verses):,} verses, {len(ids):,} tokens", flush=True)
    follow = model_choices(backbone, moe_ffn, ids)
    print(f"model choices: the text's own next token at {np.mean(follow == ids[1:]):.1%} of positions ({time.monotonic() - t0:.0f}s)", flush=True)
    prompts = opening_prompts(verses, args.continuations, args.seed)
    texts = continuations(backbone, moe_ffn, tok, prompts, args.continuation_tokens)
    print(f"continuations: {len(texts):,}, {sum(map(len, texts)):,} tokens ({time.monotonic() - t0:.0f}s)", flush=True)
    streams = [(ids, follow)] + [(t, None) for t in texts]
    table = NgramDrafter.build(streams, max_order=args.max_order, min_count=args.min_count, model_digest=model.digest)
    table.save(out)
    print(f"wrote {out}: {table.keys.size:,} contexts, {out.stat().st_size:,} bytes ({time.monotonic() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
