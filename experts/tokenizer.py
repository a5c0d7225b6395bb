"""Tokenize and detokenize exactly as llama.cpp does for a GGUF's ``tokenizer.ggml.*`` metadata.

A node must turn text into the very token ids the reference engine would, or its
logits are compared against a different prompt. The merging itself is HF
``tokenizers``' BPE; this module only configures it the way llama.cpp's
``llama-vocab.cpp`` behaves for each file:

* ``gpt2`` (byte-level BPE): text is split by the regexes llama.cpp hard-codes for
  ``tokenizer.ggml.pre`` (one table below), mapped to GPT-2's byte alphabet and
  merged by rank.
* ``llama`` (SentencePiece, llama.cpp's ``llm_tokenizer_spm``): spaces become U+2581,
  a dummy space is put in front of every run of text, adjacent pieces are merged
  greedily by the score of the piece they form, and characters missing from the
  vocab fall back to ``<0xXX>`` byte tokens. HF's own llama conversion expresses
  this as a BPE whose merges are every split of every piece, ranked by score.

Decoding does not use HF: a token stands for fixed bytes (``token_bytes``, the same
as llama.cpp's ``token_to_piece`` without special tokens), so text is their
concatenation.

Known differences from llama.cpp (measured against llama-cpp-python 0.3.36):

* Byte-level BPE: the 4,382 letters and digits new in Unicode 16.0 (Todhri, Garay,
  Tulu-Tigalari, ...) are unassigned to the regex engine inside ``tokenizers``
  (Unicode 15), so words containing them split differently.
* SentencePiece: where pieces of equal score compete, llama.cpp takes the leftmost
  pair and we take a fixed order; the ``tokenizer.spm_score_ties`` warning says when
  a vocab has such pieces. Vocabs with distinct scores matched exactly.
* ``decode`` inverts ``encode``; it skips the clean-up ``llama_detokenize`` does
  for some BPE vocabs (removing the space in " ?", " 's", ...), which loses text.
* llama.cpp retypes some NORMAL tokens named like end-of-turn markers
  (``<|im_end|>``, ...) as control tokens; we keep the file's types.
"""

from __future__ import annotations

import codecs
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import gguf
import structlog
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from .config import TokenizerSpec
from .errors import ModelFormatError

log = structlog.get_logger(__name__)

KEY = gguf.Keys.Tokenizer
TokenType = gguf.TokenType
V = gguf.GGUFValueType
SPACE_MARK = "\u2581"  # SentencePiece's visible space

# --- pre-tokenizers, as llama.cpp's llm_tokenizer_bpe hard-codes them -------------------------

# The case-insensitive contractions are spelled out ('[sS]') as llama.cpp does: a
# regex engine's (?i:) would also match case-folded look-alikes such as U+017F.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 (qwen35): qwen2's, with combining marks counted as letters (llama-vocab.cpp's QWEN35).
_QWEN35_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# bailingmoe / bailingmoe2: Ling's regex as llama.cpp rewrites it (possessive quantifiers made greedy), one digit a word.
_BAILINGMOE_RE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_LLAMA3_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's regex (gpt-4o for gpt-oss, minimax-m2), as llama.cpp rewrites it: letter runs split at case changes via lookaheads.
_UPPERISH = r"((?=[\p{L}])([^a-z]))"
_LOWERISH = r"((?=[\p{L}])([^A-Z]))"
_GPT4O_RE = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek-V3 / R1 (deepseek-v3): digits in threes, CJK runs, then its word regex, applied in turn (llama-vocab.cpp's DEEPSEEK3_LLM).
_DEEPSEEK3_RES = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# Kimi K2 (kimi-k2): Han runs, then words of any other letters. tokenization_kimi.py's pattern splits words at case
# changes and counts marks as letters, but llama.cpp's hand-written splitter (unicode.cpp) does neither: this is its.
_KIMI_K2_RE = (
    r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{L}&&[^\p{Han}]]+" + _CONTRACTIONS + r"?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text into words before BPE, for one ``tokenizer.ggml.pre`` value."""

    regexes: tuple[str, ...]  # applied in turn; each splits every piece of the last, keeping matches and gaps
    ignore_merges: bool = False  # a word that is itself in the vocab is one token, unmerged (llama3)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    default_bos: bool = True  # False: no BOS unless the file names tokenizer.ggml.bos_token_id (llama.cpp's NULL)


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2 = PreTokenizer((_GPT2_RE,))
_QWEN2 = PreTokenizer((_QWEN2_RE,))
_QWEN35 = PreTokenizer((_QWEN35_RE,))
_LLAMA3 = PreTokenizer((_LLAMA3_RE,), ignore_merges=True, add_bos=True)
# llama.cpp's CHATGLM4 regex is llama3's. For glm4 / glm5 / chatglm-bpe it sets special_bos_id = LLAMA_TOKEN_NULL
# before reading the file's keys: such a vocab has a BOS only if the file names one (GLM files name [gMASK]), and
# gets it in front only if tokenizer.ggml.add_bos_token also says so.
_GLM4 = PreTokenizer((_LLAMA3_RE,), ignore_merges=True, default_bos=False)
_CHATGLM_BPE = PreTokenizer((_LLAMA3_RE,), default_bos=False)
_GPT4O = PreTokenizer((_GPT4O_RE,))
_BAILINGMOE = PreTokenizer((_BAILINGMOE_RE,))
_DEEPSEEK3 = PreTokenizer(_DEEPSEEK3_RES)
_KIMI_K2 = PreTokenizer((_KIMI_K2_RE,))

# Names llama.cpp maps to the same behaviour share a row.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": _QWEN35,  # Qwen3.5 / Qwen3.6
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "olmo": _GPT2,
    "glm4": _GLM4,
    "glm5": _GLM4,
    "chatglm-bpe": _CHATGLM_BPE,
    "minimax-m2": _GPT4O,
    "gpt-4o": _GPT4O,  # gpt-oss
    "bailingmoe": _BAILINGMOE,
    "bailingmoe2": _BAILINGMOE,
    "deepseek-v3": _DEEPSEEK3,  # DeepSeek-V3 / R1
    "kimi-k2": _KIMI_K2,
    "llama4": _GPT4O,  # Llama 4 Scout / Maverick (llama-vocab.cpp maps it to GPT-4o's regex)
}
SUPPORTED_MODELS = ("gpt2", "llama")


def _pre_tokenizer(pre: str) -> PreTokenizer:
    try:
        return PRE_TOKENIZERS[pre]
    except KeyError:
        raise ModelFormatError(
            f"{KEY.PRE} = {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        ) from None


def _check_model(model: str) -> None:
    if model not in SUPPORTED_MODELS:
        raise ModelFormatError(f"{KEY.MODEL} = {model!r} is not supported; supported: {', '.join(SUPPORTED_MODELS)}")


# --- reading the spec from GGUF ------------------------------------------------------------------

_INTS = frozenset({V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64})
_STRINGS = frozenset({V.STRING})


def _value(reader: gguf.GGUFReader, key: str, allowed: frozenset, *, array: bool) -> Any:
    """The value of *key*, None when absent; ModelFormatError when of another type."""
    field = reader.get_field(key)
    if field is None:
        return None
    types = field.types
    is_array = bool(types) and types[0] == V.ARRAY
    elem = types[-1] if types else None
    if is_array != array or (array and len(types) != 2) or elem not in allowed:
        shape = "array of " if array else ""
        want = " or ".join(sorted(t.name for t in allowed))
        got = "/".join(t.name for t in types)
        raise ModelFormatError(f"GGUF key {key} has type {got}, expected {shape}{want}")
    try:
        return field.contents()
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"GGUF key {key} holds a string that is not UTF-8: {e}") from None


def _string(reader: gguf.GGUFReader, key: str) -> str | None:
    return _value(reader, key, _STRINGS, array=False)


def _int(reader: gguf.GGUFReader, key: str) -> int | None:
    return _value(reader, key, _INTS, array=False)


def _bool(reader: gguf.GGUFReader, key: str) -> bool | None:
    value = _value(reader, key, frozenset({V.BOOL}), array=False)
    return None if value is None else bool(value)


def _per_token(values: list | None, key: str, n_tokens: int) -> list | None:
    # llama.cpp accepts longer arrays and reads the first n_tokens entries.
    if values is not None and len(values) < n_tokens:
        raise ModelFormatError(f"GGUF key {key} has {len(values)} entries for {n_tokens} tokens")
    return None if values is None else values[:n_tokens]


def _special_id(reader: gguf.GGUFReader, key: str, default: int | None, n_tokens: int) -> int | None:
    value = _int(reader, key)
    if value is None:
        return default if default is not None and default < n_tokens else None
    if not 0 <= value < n_tokens:
        raise ModelFormatError(f"GGUF key {key} = {value} is outside the vocab of {n_tokens} tokens")
    return value


# llama.cpp's special-token ids when the file names none.
_DEFAULT_IDS: dict[str, dict[str, int | None]] = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11, "unk": None}}


def tokenizer_spec_from_reader(reader: gguf.GGUFReader) -> TokenizerSpec:
    """The tokenizer of a GGUF file, with llama.cpp's defaults filled in for absent keys.

    ``spec.extra`` holds ``tokenizer.ggml.add_space_prefix`` (under that key) when the
    file sets it, so writing the spec back reproduces the file's behaviour.
    """
    model = _string(reader, KEY.MODEL)
    if model is None:
        raise ModelFormatError(f"GGUF key {KEY.MODEL} is missing: the file carries no tokenizer")
    _check_model(model)
    pre = _string(reader, KEY.PRE) or "default"

    tokens = _value(reader, KEY.LIST, _STRINGS, array=True)
    if not tokens:
        raise ModelFormatError(f"GGUF key {KEY.LIST} is missing or empty")
    n = len(tokens)
    # llama.cpp renames empty tokens rather than failing; so do we.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = _value(reader, KEY.TOKEN_TYPE, frozenset({V.INT32}), array=True)
    types = _per_token(types, KEY.TOKEN_TYPE, n) or [int(TokenType.NORMAL)] * n
    scores = _value(reader, KEY.SCORES, frozenset({V.FLOAT32, V.INT32}), array=True)
    scores = _per_token(scores, KEY.SCORES, n)
    merges = _value(reader, KEY.MERGES, _STRINGS, array=True)
    pre_tok = _pre_tokenizer(pre) if model == "gpt2" else None
    add_bos_default = pre_tok.add_bos if pre_tok else True  # True: llama.cpp's SPM default

    defaults = _DEFAULT_IDS[model]
    default_bos = pre_tok is None or pre_tok.default_bos
    bos = _special_id(reader, KEY.BOS_ID, defaults["bos"] if default_bos else None, n)
    eos = _special_id(reader, KEY.EOS_ID, defaults["eos"], n)
    if (bos is None and default_bos) or eos is None:
        missing = KEY.BOS_ID if bos is None and default_bos else KEY.EOS_ID
        raise ModelFormatError(f"GGUF key {missing} is missing and llama.cpp's default is outside the vocab")
    add_bos = _bool(reader, KEY.ADD_BOS)
    if bos is None and (add_bos_default if add_bos is None else add_bos):  # llama.cpp would abort at tokenize
        raise ModelFormatError(f"{KEY.ADD_BOS} is true but the file names no {KEY.BOS_ID}, and {KEY.PRE} = {pre!r} has no default BOS")
    extra: dict = {}
    add_space_prefix = _bool(reader, KEY.ADD_PREFIX)
    if add_space_prefix is not None:
        extra[KEY.ADD_PREFIX] = add_space_prefix

    spec = TokenizerSpec(
        model=model,
        tokens=tokens,
        token_types=[int(t) for t in types],
        bos_id=bos,
        eos_id=eos,
        pre=pre,
        scores=None if scores is None else [float(s) for s in scores],
        merges=merges,
        unk_id=_special_id(reader, KEY.UNK_ID, defaults["unk"], n),
        pad_id=_special_id(reader, KEY.PAD_ID, None, n),
        add_bos=add_bos_default if add_bos is None else add_bos,
        extra=extra,
    )
    _validate(spec)
    return spec


def _validate(spec: TokenizerSpec) -> None:
    _check_model(spec.model)
    n = len(spec.tokens)
    if n == 0:
        raise ModelFormatError(f"{KEY.LIST} is empty")
    if len(spec.token_types) != n:
        raise ModelFormatError(f"{KEY.TOKEN_TYPE} has {len(spec.token_types)} entries for {n} tokens")
    if spec.scores is not None and len(spec.scores) != n:
        raise ModelFormatError(f"{KEY.SCORES} has {len(spec.scores)} entries for {n} tokens")
    for key, value in ((KEY.BOS_ID, spec.bos_id), (KEY.EOS_ID, spec.eos_id)):
        if value is not None and not 0 <= value < n:
            raise ModelFormatError(f"{key} = {value} is outside the vocab of {n} tokens")
    seen: dict[str, int] = {}
    for i, t in enumerate(spec.tokens):
        if t in seen:
            raise ModelFormatError(f"{KEY.LIST}: duplicate token {t!r} at ids {seen[t]} and {i}")
        seen[t] = i
    if spec.model == "gpt2":
        _pre_tokenizer(spec.pre)
        if spec.merges is None:
            raise ModelFormatError(f"GGUF key {KEY.MERGES} is missing; a gpt2 (BPE) tokenizer needs it")


# --- token bytes ---------------------------------------------------------------------------------


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte alphabet, reversed: printable bytes stand for themselves, the rest for U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = sorted(set(range(256)) - set(printable))
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_GPT2_BYTES = _gpt2_unicode_to_byte()


def _byte_token_value(text: str, token_id: int) -> int:
    if len(text) != 6 or not text.startswith("<0x") or not text.endswith(">"):
        raise ModelFormatError(f"{KEY.LIST}: byte token {token_id} is {text!r}, not <0xXX>")
    try:
        return int(text[3:5], 16)
    except ValueError:
        raise ModelFormatError(f"{KEY.LIST}: byte token {token_id} is {text!r}, not <0xXX>") from None


def _piece(spec: TokenizerSpec, token_id: int) -> bytes:
    """llama.cpp's ``token_to_piece(id, special=false)``, as bytes."""
    text, ttype = spec.tokens[token_id], spec.token_types[token_id]
    if ttype == TokenType.USER_DEFINED:
        return text.encode()
    if ttype == TokenType.BYTE:
        return bytes([_byte_token_value(text, token_id)])
    if ttype != TokenType.NORMAL:  # control, unknown, unused, undefined: nothing
        return b""
    if spec.model == "llama":
        return text.replace(SPACE_MARK, " ").encode()
    out = bytearray()
    for ch in text:
        if ch in _GPT2_BYTES:
            out.append(_GPT2_BYTES[ch])
        else:  # llama.cpp's llama_decode_text marks characters outside the byte alphabet this way
            out += b"[UNK_BYTE_0x" + ch.encode().hex().encode() + text.encode() + b"]"
    return bytes(out)


# --- building the HF tokenizer -------------------------------------------------------------------


def _bpe_merges(spec: TokenizerSpec, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs, in rank order, keeping what HF's BPE can hold.

    llama.cpp splits each entry at its first space after position 0 and keeps the
    first rank of a repeated pair; HF rejects pairs whose parts or result are not
    tokens, which llama.cpp could only use on a broken vocab.
    """
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    dropped = 0
    for merge in spec.merges or ():
        pos = merge.find(" ", 1)
        pair = (merge[:pos], merge[pos + 1 :]) if pos > 0 else None
        if pair is None or pair in seen:
            continue
        seen.add(pair)
        if pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab:
            pairs.append(pair)
        else:
            dropped += 1
    if dropped:
        log.warning("tokenizer.merges_dropped", count=dropped, reason="part or result not in vocab")
    return pairs


def _spm_merges(spec: TokenizerSpec, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, best score first (HF's llama conversion).

    llama.cpp merges the adjacent pair forming the highest-scoring token, leftmost on
    a tie; ranking pairs by that score makes BPE do the same. Pairs forming tokens of
    equal score are ordered by token id, which can differ from llama.cpp's leftmost
    rule only when two such pairs are candidates at once; a warning counts such tokens.
    """
    scores = spec.scores or [0.0] * len(spec.tokens)
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for token, tid in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[tid], tid, cut, (left, right)))
    ranked.sort()
    formed = Counter(score for score, _ in {(r[0], r[1]) for r in ranked})
    tied = sum(n for n in formed.values() if n > 1)
    if tied:
        log.warning("tokenizer.spm_score_ties", tokens=tied, effect="may differ from llama.cpp where they compete")
    return [pair for *_, pair in ranked]


def _build_hf(spec: TokenizerSpec) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(spec.tokens)}
    if spec.model == "gpt2":
        pre = _pre_tokenizer(spec.pre)
        hf = HFTokenizer(BPE(vocab=vocab, merges=_bpe_merges(spec, vocab), ignore_merges=pre.ignore_merges))
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        unk = spec.tokens[spec.unk_id] if spec.unk_id is not None else None
        hf = HFTokenizer(
            BPE(vocab=vocab, merges=_spm_merges(spec, vocab), unk_token=unk, fuse_unk=True, byte_fallback=True)
        )
        escape = normalizers.Replace(" ", SPACE_MARK)
        if spec.extra.get(KEY.ADD_PREFIX, True):
            # Prepend applies to each run of text between added tokens, as llama.cpp's dummy prefix does.
            hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), escape])
        else:
            hf.normalizer = escape
    # llama.cpp cuts user-defined tokens out of the text always, control/unknown ones only on request.
    pairs = list(zip(spec.tokens, spec.token_types))
    hf.add_tokens([AddedToken(t, normalized=False) for t, tt in pairs if tt == TokenType.USER_DEFINED])
    control = (TokenType.CONTROL, TokenType.UNKNOWN)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, tt in pairs if tt in control])
    return hf


# --- public API ----------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids of one GGUF vocab, equal to llama.cpp's for the same file."""

    def __init__(self, spec: TokenizerSpec) -> None:
        _validate(spec)
        self.spec = spec
        self.vocab_size = len(spec.tokens)
        self.bos_id = spec.bos_id
        self.eos_id = spec.eos_id
        self._pieces = [_piece(spec, i) for i in range(self.vocab_size)]
        self._strip_prefix = spec.model == "llama" and spec.extra.get(KEY.ADD_PREFIX, True)
        self._hf = _build_hf(spec)
        self._hf.encode_special_tokens = True  # control tokens in user text stay text

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> Tokenizer:
        return cls(spec)

    @cached_property
    def _hf_special(self) -> HFTokenizer:
        """A copy of the HF tokenizer that turns control-token text into the control token."""
        hf = HFTokenizer.from_str(self._hf.to_str())
        hf.encode_special_tokens = False
        return hf

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of *text*; ``add_bos=None`` follows the file, ``special`` parses control tokens.

        Lone surrogates (not Unicode, not UTF-8) raise UnicodeEncodeError.
        """
        try:
            ids = (self._hf_special if special else self._hf).encode(text, add_special_tokens=False).ids
        except TypeError:
            text.encode()  # HF says only "must be str"; name the real fault
            raise
        if self.spec.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ModelFormatError(f"cannot add a BOS token: the file names no {KEY.BOS_ID} and {KEY.PRE} = {self.spec.pre!r} has no default")
            return [self.bos_id, *ids]
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes *token_id* stands for (llama.cpp's piece); control tokens give b""."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocab of {self.vocab_size} tokens")
        return self._pieces[token_id]

    def decode(self, ids: Sequence[int]) -> str:
        """The text *ids* stand for; undecodable bytes become U+FFFD.

        For SentencePiece vocabs the dummy space ``encode`` put in front of the text is
        dropped (also after a BOS, unlike ``llama_detokenize``), so that
        ``decode(encode(s)) == s``.
        """
        data = b"".join(self.token_bytes(i) for i in ids)
        if self._strip_prefix and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")


class StreamDecoder:
    """Text of tokens as they are generated, never splitting a UTF-8 character.

    Emits llama.cpp's pieces as llama-cli prints them: a SentencePiece token's
    leading space is kept, since streamed tokens continue text already shown.
    """

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The complete characters that *token_id* finishes ("" while one is still partial)."""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: a trailing partial character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)
