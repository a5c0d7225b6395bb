"""Tokenizer from GGUF metadata: reading the keys, encode/decode, streaming, and equality with llama.cpp."""

from __future__ import annotations

import ctypes
import json
import random
from functools import cache
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from experts.errors import ModelFormatError
from experts.tokenizer import StreamDecoder, Tokenizer, tokenizer_spec_from_reader

K = gguf.Keys.Tokenizer
TT = gguf.TokenType
BPE_PRES = ("default", "gpt-2", "qwen2", "llama-bpe", "olmo", "glm4", "chatglm-bpe", "minimax-m2", "gpt-4o", "bailingmoe2", "deepseek-v3", "kimi-k2", "llama4", "qwen35")
USER_TOKEN = "<tool>"

# --- corpus and vocabularies trained on it -------------------------------------------------------

_WORDS = (
    "the quick brown fox jumps over a lazy dog while rivers run to the sea and mountains stand still "
    "tokenizer merges bytes into pieces models predict tokens swarm nodes share experts across machines "
    "don't won't it's we're I've you'll he'd THEY'RE naïve café façade Ünïcödé Привет мир Ελληνικά "
    "日本語 中文 テキスト 한국어 1 12 123 1234 2024 3.14 $100 +200 =300 <html> {json} [list] (paren) a_b c-d e/f"
).split()
_SEPS = (" ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", "! ", "? ", " -- ", "...", "\r\n")


@cache
def corpus() -> str:
    """About 8 KB of text mixing scripts, digits, punctuation and whitespace runs (seeded)."""
    rng = random.Random(1234)
    parts = []
    for _ in range(1400):
        parts += [rng.choice(_WORDS), rng.choice(_SEPS)]
    return "".join(parts)


@cache
def bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE trained here: tokens, token types and merges as a GGUF holds them."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    hf.train_from_iterator([corpus()], trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + [USER_TOKEN]
    types = [TT.CONTROL if t == "<|endoftext|>" else TT.NORMAL for t in tokens[:-1]] + [TT.USER_DEFINED]
    merges = [" ".join(m) for m in model["merges"]]
    return tokens, [int(t) for t in types], merges


@cache
def spm_vocab(shuffled_scores: bool = False) -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece-style vocab: <unk> <s> </s>, 256 <0xXX> byte tokens, pieces with U+2581 spaces.

    The pieces come from BPE training on U+2581-joined words, scored by merge order
    like SentencePiece's BPE (or with shuffled distinct scores, to exercise llama.cpp's
    greedy highest-score merging rather than a trained order).
    """
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    hf.train_from_iterator([corpus()], trainers.BpeTrainer(vocab_size=700, show_progress=False))
    learned = json.loads(hf.to_str())["model"]["vocab"]
    pieces = sorted(learned, key=learned.get)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, USER_TOKEN]
    types = [TT.UNKNOWN, TT.CONTROL, TT.CONTROL, *[TT.BYTE] * 256, *[TT.NORMAL] * len(pieces), TT.USER_DEFINED]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]
    if shuffled_scores:
        order = [-float(i) for i in range(len(pieces))]
        random.Random(7).shuffle(order)
        scores = [0.0] * 259 + order + [0.0]
    return tokens, [int(t) for t in types], scores


# --- GGUF files holding only metadata ------------------------------------------------------------


def write_gguf(path: Path, kv: dict) -> Path:
    """A metadata-only GGUF with the llama hparams llama.cpp needs to load a vocab, plus *kv*."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def bpe_kv(pre: str) -> dict:
    tokens, types, merges = bpe_vocab()
    eot = tokens.index("<|endoftext|>")
    return {K.MODEL: "gpt2", K.PRE: pre, K.LIST: tokens, K.TOKEN_TYPE: types, K.MERGES: merges,
            K.BOS_ID: eot, K.EOS_ID: eot}  # fmt: skip


def spm_kv(*, shuffled_scores: bool = False, add_space_prefix: bool | None = None) -> dict:
    tokens, types, scores = spm_vocab(shuffled_scores)
    kv = {K.MODEL: "llama", K.LIST: tokens, K.TOKEN_TYPE: types, K.SCORES: scores,
          K.BOS_ID: 1, K.EOS_ID: 2, K.UNK_ID: 0}  # fmt: skip
    if add_space_prefix is not None:
        kv[K.ADD_PREFIX] = add_space_prefix
    return kv


VARIANTS = {
    **{f"bpe-{pre}": (lambda pre=pre: bpe_kv(pre)) for pre in BPE_PRES},
    "bpe-glm4-nobos": lambda: {k: v for k, v in bpe_kv("glm4").items() if k != K.BOS_ID},  # llama.cpp: no BOS at all
    "bpe-glm4-addbos": lambda: {**bpe_kv("glm4"), K.ADD_BOS: True},  # the file's BOS, in front
    "spm": lambda: spm_kv(),
    "spm-shuffled": lambda: spm_kv(shuffled_scores=True),
    "spm-noprefix": lambda: spm_kv(add_space_prefix=False),
}


@pytest.fixture(scope="session")
def tok_files(tmp_path_factory) -> dict[str, Path]:
    """One GGUF per vocab variant, written once per session."""
    d = tmp_path_factory.mktemp("tok")
    return {name: write_gguf(d / f"{name}.gguf", make()) for name, make in VARIANTS.items()}


@pytest.fixture(scope="session")
def tok_all(tok_files) -> dict[str, Tokenizer]:
    """A Tokenizer per variant, read back from its GGUF file."""
    return {name: Tokenizer.from_spec(tokenizer_spec_from_reader(gguf.GGUFReader(p))) for name, p in tok_files.items()}


def read_spec(path: Path):
    return tokenizer_spec_from_reader(gguf.GGUFReader(path))


def boundaries(tok: Tokenizer, ids: list[int]) -> set[int]:
    """Byte offsets where one token ends and the next begins."""
    out, pos = set(), 0
    for i in ids[:-1]:
        pos += len(tok.token_bytes(i))
        out.add(pos)
    return out


# --- reading the spec ----------------------------------------------------------------------------


def test_reader_returns_the_written_bpe_metadata(tmp_path):
    """Tokens, types, merges, ids and pre come back exactly as written."""
    kv = bpe_kv("qwen2")
    spec = read_spec(write_gguf(tmp_path / "t.gguf", kv))
    assert spec.model == "gpt2" and spec.pre == "qwen2"
    assert spec.tokens == kv[K.LIST] and spec.token_types == kv[K.TOKEN_TYPE] and spec.merges == kv[K.MERGES]
    assert (spec.bos_id, spec.eos_id, spec.add_bos, spec.scores) == (kv[K.BOS_ID], kv[K.EOS_ID], False, None)


def test_reader_fills_in_llama_cpp_defaults(tmp_path):
    """Absent keys get llama.cpp's defaults: SPM ids 1/2/0 and add_bos; llama-bpe add_bos; pre 'default'."""
    kv = spm_kv()
    for key in (K.BOS_ID, K.EOS_ID, K.UNK_ID):
        del kv[key]
    spm = read_spec(write_gguf(tmp_path / "spm.gguf", kv))
    assert (spm.bos_id, spm.eos_id, spm.unk_id, spm.add_bos, spm.extra) == (1, 2, 0, True, {})
    assert read_spec(write_gguf(tmp_path / "l3.gguf", bpe_kv("llama-bpe"))).add_bos is True
    no_pre = bpe_kv("x")
    del no_pre[K.PRE]
    assert read_spec(write_gguf(tmp_path / "np.gguf", no_pre)).pre == "default"
    explicit = read_spec(write_gguf(tmp_path / "e.gguf", {**bpe_kv("llama-bpe"), K.ADD_BOS: False}))
    assert explicit.add_bos is False


def test_reader_keeps_add_space_prefix_in_extra(tmp_path):
    """tokenizer.ggml.add_space_prefix lands in spec.extra under its GGUF key."""
    spec = read_spec(write_gguf(tmp_path / "t.gguf", spm_kv(add_space_prefix=False)))
    assert spec.extra == {K.ADD_PREFIX: False}


@pytest.mark.parametrize("missing", [K.MODEL, K.LIST, K.MERGES])
def test_reader_names_the_missing_key(tmp_path, missing):
    """A file without a required tokenizer key fails with that key in the message."""
    kv = bpe_kv("gpt-2")
    del kv[missing]
    with pytest.raises(ModelFormatError, match=missing.replace(".", r"\.")):
        read_spec(write_gguf(tmp_path / "t.gguf", kv))


@pytest.mark.parametrize(
    ("key", "value"),
    [(K.TOKEN_TYPE, [1.0, 2.0]), (K.BOS_ID, "one"), (K.MODEL, 3), (K.LIST, [1, 2, 3]), (K.ADD_BOS, 1)],
)
def test_reader_names_a_mistyped_key(tmp_path, key, value):
    """A key of the wrong GGUF type fails with that key in the message."""
    with pytest.raises(ModelFormatError, match=key.replace(".", r"\.")):
        read_spec(write_gguf(tmp_path / "t.gguf", {**bpe_kv("gpt-2"), key: value}))


def test_reader_rejects_short_arrays_bad_ids_and_duplicates(tmp_path):
    """Too few token types, an id outside the vocab and a repeated token each name the key."""
    kv = bpe_kv("gpt-2")
    cases = {
        K.TOKEN_TYPE: {K.TOKEN_TYPE: kv[K.TOKEN_TYPE][:-1]},
        K.EOS_ID: {K.EOS_ID: len(kv[K.LIST])},
        K.LIST: {K.LIST: [*kv[K.LIST][:-1], kv[K.LIST][0]]},
    }
    for i, (key, change) in enumerate(cases.items()):
        with pytest.raises(ModelFormatError, match=key.replace(".", r"\.")):
            read_spec(write_gguf(tmp_path / f"{i}.gguf", {**kv, **change}))


def test_unknown_pre_tokenizer_names_it_and_lists_supported(tmp_path):
    """An unsupported tokenizer.ggml.pre is named, next to the supported values."""
    with pytest.raises(ModelFormatError) as err:
        read_spec(write_gguf(tmp_path / "t.gguf", bpe_kv("tekken")))
    assert "'tekken'" in str(err.value)
    assert all(p in str(err.value) for p in BPE_PRES)


def test_unsupported_model_is_rejected(tmp_path):
    """tokenizer.ggml.model other than gpt2/llama fails, naming the value."""
    with pytest.raises(ModelFormatError, match="'bert'"):
        read_spec(write_gguf(tmp_path / "t.gguf", {**bpe_kv("gpt-2"), K.MODEL: "bert"}))


# --- byte-level BPE ------------------------------------------------------------------------------


def test_bpe_merges_and_known_pieces(tok_all):
    """Frequent words become few tokens and the pieces spell the text byte for byte."""
    tok = tok_all["bpe-gpt-2"]
    text = "the quick brown fox"
    ids = tok.encode(text)
    assert len(ids) < len(text) // 2
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(tok.spec.tokens.index("\u0120the")) == b" the"  # GPT-2 alphabet: U+0120 is a space


def test_pre_tokenizer_decides_digit_grouping(tok_all):
    """qwen2 splits digits one by one, llama-bpe and default in threes; the merges alone do not decide."""
    digits = "1234567"
    qwen = tok_all["bpe-qwen2"]
    assert boundaries(qwen, qwen.encode(digits)) == {1, 2, 3, 4, 5, 6}
    for name in ("bpe-llama-bpe", "bpe-default"):
        tok = tok_all[name]
        cuts = boundaries(tok, tok.encode(digits))
        assert {3, 6} <= cuts and cuts != {1, 2, 3, 4, 5, 6}


def test_llama3_keeps_whole_vocab_words_without_merging(tmp_path):
    """With llama-bpe a word that is itself a token is one token even if the merges never build it."""
    alphabet = list(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*sorted(alphabet), "ab", "abc"]
    kv = {K.MODEL: "gpt2", K.LIST: tokens, K.TOKEN_TYPE: [1] * len(tokens), K.MERGES: ["a b"], K.BOS_ID: 0, K.EOS_ID: 0}
    by_pre = {}
    for pre in ("gpt-2", "llama-bpe"):
        tok = Tokenizer.from_spec(read_spec(write_gguf(tmp_path / f"{pre}.gguf", {**kv, K.PRE: pre})))
        by_pre[pre] = [tok.spec.tokens[i] for i in tok.encode("abc", add_bos=False)]
    assert by_pre == {"gpt-2": ["ab", "c"], "llama-bpe": ["abc"]}


@pytest.mark.parametrize("pre", BPE_PRES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_bpe_round_trips_any_text(tok_all, pre, text):
    """decode(encode(s)) == s for arbitrary Unicode under every pre-tokenizer."""
    tok = tok_all[f"bpe-{pre}"]
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_control_tokens_are_text_unless_special(tok_all):
    """<|endoftext|> in user text is tokenized as text; special=True yields the control token; it decodes to ""."""
    tok = tok_all["bpe-gpt-2"]
    eot = tok.spec.tokens.index("<|endoftext|>")
    assert eot not in tok.encode("a<|endoftext|>b")
    assert tok.encode("a<|endoftext|>b", special=True)[1] == eot
    assert tok.token_bytes(eot) == b"" and tok.decode([eot]) == ""


def test_user_defined_tokens_are_always_cut_out(tok_all):
    """A user-defined token is one token wherever it appears, and decodes to its own text."""
    for name in ("bpe-gpt-2", "spm"):
        tok = tok_all[name]
        uid = tok.spec.tokens.index(USER_TOKEN)
        ids = tok.encode(f"x{USER_TOKEN}y")
        assert ids.count(uid) == 1
        assert tok.token_bytes(uid) == USER_TOKEN.encode()


def test_add_bos_follows_the_file_unless_given(tok_all):
    """add_bos=None uses the file's flag; True/False override it."""
    bpe, spm = tok_all["bpe-gpt-2"], tok_all["spm"]
    assert bpe.encode("hi") == bpe.encode("hi", add_bos=False) and bpe.encode("hi", add_bos=True)[0] == bpe.bos_id
    assert spm.encode("hi")[0] == spm.bos_id == 1 and spm.encode("hi", add_bos=False)[0] != 1
    assert spm.decode(spm.encode("hi there")) == "hi there"


def test_lone_surrogates_raise_unicode_encode_error(tok_all):
    """A str that is not valid Unicode fails with UnicodeEncodeError, for both vocab kinds."""
    for name in ("bpe-gpt-2", "spm"):
        with pytest.raises(UnicodeEncodeError):
            tok_all[name].encode("a\udc80b")


def test_token_bytes_rejects_ids_outside_the_vocab(tok_all):
    """Ids below 0 or at/above vocab_size raise ValueError."""
    tok = tok_all["bpe-gpt-2"]
    for bad in (-1, tok.vocab_size):
        with pytest.raises(ValueError, match="outside the vocab"):
            tok.token_bytes(bad)


def test_merges_outside_the_vocab_are_dropped_with_a_warning(tmp_path):
    """A merge whose result is not a token is left out (HF cannot hold it) and logged; encoding still works."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*alphabet, "ab"]
    kv = {K.MODEL: "gpt2", K.PRE: "gpt-2", K.LIST: tokens, K.TOKEN_TYPE: [1] * len(tokens),
          K.MERGES: ["a b", "b c", "nospace"], K.BOS_ID: 0, K.EOS_ID: 0}  # fmt: skip
    with capture_logs() as logs:
        tok = Tokenizer.from_spec(read_spec(write_gguf(tmp_path / "t.gguf", kv)))
    assert [e["event"] for e in logs] == ["tokenizer.merges_dropped"] and logs[0]["count"] == 1
    assert [tok.spec.tokens[i] for i in tok.encode("abc")] == ["ab", "c"]


# --- SentencePiece -------------------------------------------------------------------------------


def test_spm_puts_a_dummy_space_in_front(tok_all):
    """With add_space_prefix (default) the first piece starts with a space; without it, not; "" gives []."""
    spm, bare = tok_all["spm"], tok_all["spm-noprefix"]
    assert spm.token_bytes(spm.encode("the dog", add_bos=False)[0]).startswith(b" ")
    assert not bare.token_bytes(bare.encode("the dog", add_bos=False)[0]).startswith(b" ")
    assert spm.encode("", add_bos=False) == [] == bare.encode("", add_bos=False)


def test_spm_falls_back_to_byte_tokens(tok_all):
    """A character missing from the vocab becomes its UTF-8 bytes as <0xXX> tokens."""
    tok = tok_all["spm"]
    emoji = "\N{GRINNING FACE}"
    assert emoji not in corpus()
    ids = tok.encode(emoji, add_bos=False)
    byte_ids = [tok.spec.tokens.index(f"<0x{b:02X}>") for b in emoji.encode()]
    assert ids[-4:] == byte_ids
    assert tok.decode(ids) == emoji


def test_spm_merges_the_highest_scoring_piece_first(tmp_path):
    """Greedy by score, as llama.cpp: 'abc' splits a|bc when 'bc' outscores 'ab', else ab|c."""
    base = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "ab", "bc"]
    kv = {K.MODEL: "llama", K.LIST: base, K.TOKEN_TYPE: [2, 3, 3, 1, 1, 1, 1, 1, 1], K.ADD_PREFIX: False}
    got = {}
    for name, (s_ab, s_bc) in {"ab": (-1.0, -2.0), "bc": (-2.0, -1.0)}.items():
        scores = [0.0, 0.0, 0.0, -9.0, -9.0, -9.0, -9.0, s_ab, s_bc]
        tok = Tokenizer.from_spec(read_spec(write_gguf(tmp_path / f"{name}.gguf", {**kv, K.SCORES: scores})))
        got[name] = [tok.spec.tokens[i] for i in tok.encode("abc", add_bos=False)]
    assert got == {"ab": ["ab", "c"], "bc": ["a", "bc"]}


def test_spm_warns_about_tied_scores(tmp_path):
    """Pieces that merges form with equal scores are counted in a warning (llama.cpp breaks ties by position)."""
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab", "ba"]
    scores = [0.0, 0.0, 0.0, -5.0, -5.0, -1.0, -1.0]
    kv = {K.MODEL: "llama", K.LIST: tokens, K.TOKEN_TYPE: [2, 3, 3, 1, 1, 1, 1], K.SCORES: scores}
    with capture_logs() as logs:
        Tokenizer.from_spec(read_spec(write_gguf(tmp_path / "t.gguf", kv)))
    assert [(e["event"], e["tokens"]) for e in logs] == [("tokenizer.spm_score_ties", 2)]


@pytest.mark.parametrize("name", ["spm", "spm-noprefix", "spm-shuffled"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_spm_round_trips_any_text(tok_all, name, text):
    """decode(encode(s)) == s for arbitrary Unicode (bar U+2581, which SentencePiece reads as a space)."""
    assume("\u2581" not in text and USER_TOKEN not in text)
    tok = tok_all[name]
    assert tok.decode(tok.encode(text)) == text


# --- streaming -----------------------------------------------------------------------------------


def test_stream_decoder_holds_partial_characters(tok_all):
    """Byte tokens of one emoji print nothing until the last, then the whole character."""
    tok = tok_all["spm"]
    emoji = "\N{ROCKET}"
    sd = StreamDecoder(tok)
    ids = tok.encode(emoji, add_bos=False)
    out = [sd.push(i) for i in ids]
    assert out[-4:] == ["", "", "", emoji] and sd.flush() == ""


def test_stream_decoder_flush_marks_a_cut_character(tok_all):
    """A stream ending inside a character flushes one U+FFFD."""
    tok = tok_all["spm"]
    sd = StreamDecoder(tok)
    first_byte = tok.spec.tokens.index(f"<0x{'é'.encode()[0]:02X}>")
    assert sd.push(first_byte) == "" and sd.flush() == "\ufffd"


@pytest.mark.parametrize("name", ["bpe-gpt-2", "spm"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_decoder_equals_decoding_all_pieces(tok_all, name, data):
    """For any id sequence, pushes plus flush equal the UTF-8 decoding of all pieces at once."""
    tok = tok_all[name]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    sd = StreamDecoder(tok)
    streamed = "".join(sd.push(i) for i in ids) + sd.flush()
    assert streamed == b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


# --- equality with llama.cpp ---------------------------------------------------------------------

VARIED = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t\n ", "Hello world", " Hello world", "Hello  world  ", "hello\n\nworld",
    "the quick brown fox jumps over the lazy dog.", "THE QUICK Brown fOX", "don't won't it's we're I've you'll he'd",
    "DON'T WE'RE 'S 'll 'Ll", "1", "12", "123", "1234", "1234567890", "3.14159", "$100+200=300", "a1b22c333d4444",
    "!!!???...,,,;;;", "(paren) [brack] {brace} <angle>", "a_b c-d e/f g\\h", "   leading and trailing   ",
    "naïve café façade Ünïcödé", "Привет мир", "Ελληνικά", "日本語のテキスト", "中文 text mixed 한국어",
    "\N{GRINNING FACE}\N{ROCKET} emoji \N{THUMBS UP SIGN}\N{EMOJI MODIFIER FITZPATRICK TYPE-4}",
    "\N{FAMILY}", "e\u0301 combining", "\u00a0nbsp\u3000ideographic space", "\u200bzero\u200dwidth",
    "tab\there\r\nwindows", "x  \n  y", "a  b\n\nc   d", "<|endoftext|>", "x<|endoftext|>y", "<tool>", "a<tool>b",
    " <tool> ", "\u2581marker", "ſ 'ſ 'S", "\x00nul\x01ctl", "ﬁ ligature Ⅻ roman ² sup ½",
    "the\u2028line\u2029para", "\u0085nel", "\ufffd", "a" * 300, "ab " * 100,
]


@pytest.fixture(scope="session")
def tok_llama(tok_files):
    """llama.cpp (llama-cpp-python) with vocab only, one per variant file."""
    llama_cpp = pytest.importorskip("llama_cpp")
    return {n: llama_cpp.Llama(model_path=str(p), vocab_only=True, verbose=False) for n, p in tok_files.items()}


def llama_piece(llm, token_id: int) -> bytes:
    """llama.cpp's token_to_piece(id, lstrip=0, special=false)."""
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token_id, buf, len(buf), 0, False)
    assert 0 <= n <= len(buf)
    return buf.raw[:n]


def text_mismatches(tok: Tokenizer, llm, texts, special: bool = False) -> list[tuple[str, list[int], list[int]]]:
    """The texts whose ids differ from llama.cpp's, with both id lists."""
    out = []
    for text in texts:
        ours = tok.encode(text, add_bos=False, special=special)
        theirs = llm.tokenize(text.encode(), add_bos=False, special=special)
        if ours != theirs:
            out.append((text, ours, theirs))
    return out


@pytest.mark.llama
@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_llama_cpp_on_varied_text(tok_all, tok_llama, name):
    """Token ids equal llama.cpp's for spaces, newlines, digits, punctuation, scripts, emoji and specials."""
    assert text_mismatches(tok_all[name], tok_llama[name], VARIED) == []


@pytest.mark.llama
@pytest.mark.parametrize("name", list(VARIANTS))
def test_bos_follows_llama_cpp(tok_all, tok_llama, name):
    """Whether a BOS goes in front, and which, is llama.cpp's choice for the file (add_special=True): glm4's
    pre-types have no default BOS id, so a file naming none gets none (and llama.cpp's BOS is then NULL too)."""
    tok, llm = tok_all[name], tok_llama[name]
    for text in ("hi", "Hello, world!"):
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True), text
    assert (tok.bos_id if tok.bos_id is not None else -1) == llm.token_bos()


def test_glm4_without_a_bos_id_has_none_and_refuses_to_add_one(tmp_path):
    """llama.cpp sets glm4's BOS to NULL unless the file names one; asking for a BOS then fails with one line
    (llama.cpp aborts), and so does a file whose add_bos_token is true without a BOS id."""
    kv = {k: v for k, v in bpe_kv("glm4").items() if k != K.BOS_ID}
    tok = Tokenizer.from_spec(read_spec(write_gguf(tmp_path / "nobos.gguf", kv)))
    assert tok.bos_id is None and tok.encode("hi") == tok.encode("hi", add_bos=False)
    with pytest.raises(ModelFormatError, match="names no tokenizer.ggml.bos_token_id"):
        tok.encode("hi", add_bos=True)
    with pytest.raises(ModelFormatError, match="add_bos_token is true but the file names no tokenizer.ggml.bos_token_id"):
        read_spec(write_gguf(tmp_path / "addbos.gguf", {**kv, K.ADD_BOS: True}))
    assert read_spec(write_gguf(tmp_path / "gpt2.gguf", {k: v for k, v in bpe_kv("gpt-2").items() if k != K.BOS_ID})).bos_id == 11


@pytest.mark.llama
@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_llama_cpp_when_parsing_specials(tok_all, tok_llama, name):
    """With special=True control tokens written in the text become those tokens, as in llama.cpp."""
    texts = ["<s>hi</s>", "a <|endoftext|>b<|endoftext|>", "<unk> x", " <s> <tool> </s> ", "<|endoftext|><s>"]
    assert text_mismatches(tok_all[name], tok_llama[name], texts, special=True) == []


@pytest.mark.llama
@pytest.mark.parametrize("name", list(VARIANTS))
def test_token_pieces_match_llama_cpp(tok_all, tok_llama, name):
    """Every token's bytes equal llama.cpp's token_to_piece without specials."""
    tok, llm = tok_all[name], tok_llama[name]
    assert llm.n_vocab() == tok.vocab_size
    assert [tok.token_bytes(i) for i in range(tok.vocab_size)] == [llama_piece(llm, i) for i in range(tok.vocab_size)]


_LLAMA_TEXT = st.text(
    st.one_of(st.sampled_from(list(" \t\n\r'sStTdDlLmMvVeErR0123456789.,!?$+<=>^~|-_()\"") + ["\u2581"]),
              st.characters(codec="utf-8")),
    max_size=40,
)  # fmt: skip


@pytest.mark.llama
@pytest.mark.parametrize("name", list(VARIANTS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_LLAMA_TEXT)
def test_matches_llama_cpp_on_generated_text(tok_all, tok_llama, name, text):
    """Token ids equal llama.cpp's on generated text biased to whitespace, digits, contractions and symbols."""
    assert text_mismatches(tok_all[name], tok_llama[name], [text]) == []
