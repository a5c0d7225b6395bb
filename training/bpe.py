"""Byte-level BPE (GPT-2 style) trained with ``tokenizers``, and its GGUF metadata.

llama.cpp's ``gpt2`` tokenizer with pre-tokenizer ``gpt-2`` applies the GPT-2
regex and then the merges to the GPT-2 byte-to-unicode strings, which is what
``tokenizers``' ByteLevel pre-tokenizer produces, so tokens and merges are
copied as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import gguf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from experts.config import TokenizerSpec

SPECIAL = "<|endoftext|>"


def train_bpe(lines: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train on *lines*; id 0 is ``<|endoftext|>``, ids 1..256 the bytes, then one id per merge."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def tokenizer_spec(tok: Tokenizer) -> TokenizerSpec:
    """The ``tokenizer.ggml.*`` metadata for *tok* (ids must be dense 0..n-1)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    if "" in tokens:
        raise ValueError("tokenizer ids are not dense")
    eot = vocab[SPECIAL]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    types[eot] = int(gguf.TokenType.CONTROL)
    # Older tokenizers serialise a merge as "a b", newer ones as ["a", "b"].
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return TokenizerSpec(
        model="gpt2",
        pre="gpt-2",
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_id=eot,
        eos_id=eot,
        add_bos=False,
    )
