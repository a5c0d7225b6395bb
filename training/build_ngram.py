"""Build the embedded model's n-gram draft table, experts/data/embedded.ngram.npz.

    python training/build_ngram.py            # ~15 min on one busy core

Speculative decoding with :class:`experts.speculative.NgramDrafter` proposes what this
table says follows the last few tokens. The table counts, for every context of 1..8
tokens, which token follows it in three kinds of text, all tokenized by the model's
own tokenizer (read from the GGUF):

1. the corpus, ``training/corpus/kjv.txt``, as written;
2. the corpus again, but each token replaced by the model's greedy choice at that
   place (the model reading the text in 128-token windows, the length it was trained
   on): the table should predict the model, not the Bible;
3. the model's own greedy continuations of many corpus-verse openings: once it
   strays from the text, the model still falls into its own habitual phrases.

Deterministic: the same model file gives the same table, byte for byte.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, KVCache
from experts.gguf_model import GGUFModel
from experts.moe import ungrouped_moe
from experts.slices import ExpertStore
from experts.speculative import NgramDrafter, ngram_path, speculative_generate
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
    rng, prompts = random.Random(seed), dict.fromkeys([])
    while len(prompts) < min(n, len(verses)):
        words = rng.choice(verses).split()
        prompts[" ".join(words[: rng.randint(2, 6)])] = None
    return list(prompts)


def continuations(backbone, moe_ffn, tok: Tokenizer, prompts: list[str], n_tokens: int, drafter) -> list[np.ndarray]:
    """Each prompt's tokens followed by the model's greedy continuation (speculative: same tokens, fewer passes)."""
    out = []
    for text in prompts:
        prompt = tok.encode(text)
        run = speculative_generate(backbone, prompt, n_tokens, moe_ffn, stop={tok.eos_id}, drafter=drafter)
        out.append(np.array(prompt + [t for t, _ in run], np.int64))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=EMBEDDED_MODEL)
    p.add_argument("--out", type=Path, help="default: beside the model, <name>.ngram.npz")
    p.add_argument("--max-order", type=int, default=8, help="longest context, in tokens")
    p.add_argument("--min-count", type=int, default=2, help="keep a context only if its top follower was seen this often")
    p.add_argument("--continuations", type=int, default=2000, help="greedy continuations of verse openings to add (0: none)")
    p.add_argument("--continuation-tokens", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="picks the verse openings")
    args = p.parse_args(argv)
    out = args.out or ngram_path(args.model)

    t0 = time.monotonic()
    model = GGUFModel(args.model)
    backbone, store = Backbone(model), ExpertStore(model)
    tok = Tokenizer.from_spec(model.tokenizer_spec)

    def moe_ffn(i, x, e, w):
        return ungrouped_moe(store, i, x, e, w)

    verses = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    ids = np.array([t for v in verses for t in tok.encode(v)], np.int64)
    print(f"corpus: {len(verses):,} verses, {len(ids):,} tokens", flush=True)
    follow = model_choices(backbone, moe_ffn, ids)
    print(f"model choices: agree with the text at {np.mean(follow == ids[1:]):.1%} of positions ({time.monotonic() - t0:.0f}s)", flush=True)
    streams = [(ids, None), (ids, follow)]
    build = dict(max_order=args.max_order, min_count=args.min_count, model_digest=model.digest)
    if args.continuations:
        # The table so far drafts the continuations: the same tokens as plain greedy decoding, in fewer passes.
        first = NgramDrafter.build(streams, **build)
        prompts = opening_prompts(verses, args.continuations, args.seed)
        texts = continuations(backbone, moe_ffn, tok, prompts, args.continuation_tokens, first)
        streams += [(t, None) for t in texts]
        print(f"continuations: {len(texts):,}, {sum(map(len, texts)):,} tokens ({time.monotonic() - t0:.0f}s)", flush=True)
    table = NgramDrafter.build(streams, **build)
    table.save(out)
    print(f"wrote {out}: {table.keys.size:,} contexts, {out.stat().st_size:,} bytes ({time.monotonic() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
