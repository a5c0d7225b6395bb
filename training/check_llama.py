"""Check the exported GGUF against llama.cpp: logits, greedy text and tokenization.

    python training/check_llama.py [--model experts/data/embedded.gguf] [--llama-python PY]

The torch side loads the tensors back from the GGUF into :class:`Qwen2MoeLM`;
the llama.cpp side runs through llama-cpp-python (the ``llama`` extra), in
*PY*'s interpreter when given, so torch and llama.cpp may live in different
environments. Exits 1 if the logits disagree (min cosine below --min-cos) or the
two tokenizers split a text differently.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TEXTS = [
    "And God said, Let there be light: and there was light.\n",
    "The LORD is my shepherd; I shall not want.\n",
    "Hello, world! It's 2025 -- naïve café, 100% \t tabs\n\nand  spaces.",
]
LOGIT_TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.\n"
    "Blessed is the man that walketh not in the counsel of the ungodly, nor standeth in the way of sinners.\n"
    "Jesus wept. Then said the Jews, Behold how he loved him!\n"
    # Isaiah 40:1-5, a book outside the training corpus; makes the sequence ~300 tokens long.
    "Comfort ye, comfort ye my people, saith your God. Speak ye comfortably to Jerusalem, and cry unto her, "
    "that her warfare is accomplished, that her iniquity is pardoned: for she hath received of the LORD's hand "
    "double for all her sins.\nThe voice of him that crieth in the wilderness, Prepare ye the way of the LORD, "
    "make straight in the desert a highway for our God.\nEvery valley shall be exalted, and every mountain and "
    "hill shall be made low: and the crooked shall be made straight, and the rough places plain:\n"
)
PROMPT = "And God said"
N_GREEDY = 48


def llama_side(request: dict) -> dict:
    """Runs under the interpreter that has llama_cpp; imports nothing from this project."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=request["model"], logits_all=True, n_ctx=512, type_k=0, type_v=0, n_threads=1, verbose=False
    )
    ids = request["ids"]
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    tokenized = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in request["texts"]]
    llm.reset()
    greedy = list(request["prompt_ids"])
    llm.eval(greedy)
    for _ in range(request["n_greedy"]):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        llm.eval([nxt])
    return {"logits": logits.tolist(), "tokenized": tokenized, "greedy": greedy}


def run_llama(python: str | None, request: dict) -> dict:
    if python is None:
        return llama_side(request)
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp, "req.json"), Path(tmp, "out.json")
        req.write_text(json.dumps(request))
        subprocess.run([python, __file__, "--llama-only", str(req), str(out)], check=True)
        return json.loads(out.read_text())


def read_gguf(path: Path) -> tuple[dict[str, np.ndarray], list[str]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.array(t.data).reshape([int(n) for n in reversed(t.shape)]) for t in reader.tensors}
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return tensors, tokens


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=root / "experts" / "data" / "embedded.gguf")
    p.add_argument("--llama-python", help="interpreter that can import llama_cpp (default: this one)")
    p.add_argument("--min-cos", type=float, default=0.9999)
    p.add_argument("--llama-only", nargs=2, metavar=("REQUEST", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.llama_only:
        req, out = args.llama_only
        Path(out).write_text(json.dumps(llama_side(json.loads(Path(req).read_text()))))
        return 0

    import torch

    from bpe import train_bpe
    from embedded_model import Qwen2MoeLM
    from train_embedded import CORPUS, VOCAB_SIZE, model_config

    torch.set_num_threads(1)
    tensors, gguf_tokens = read_gguf(args.model)
    tok = train_bpe(CORPUS.read_text(encoding="utf-8").splitlines(keepends=True), VOCAB_SIZE)
    vocab = tok.get_vocab(with_added_tokens=True)
    if sorted(vocab, key=vocab.__getitem__) != gguf_tokens:
        print("FAIL: the GGUF vocabulary is not the one trained from the corpus")
        return 1
    model = Qwen2MoeLM(model_config(len(gguf_tokens)))
    model.load_arrays(tensors)
    model.eval()

    ids = tok.encode(LOGIT_TEXT).ids
    prompt_ids = tok.encode(PROMPT).ids
    request = {
        "model": str(args.model),
        "ids": ids,
        "texts": TEXTS,
        "prompt_ids": prompt_ids,
        "n_greedy": N_GREEDY,
    }
    ref = run_llama(args.llama_python, request)

    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0].numpy()
    theirs = np.array(ref["logits"], dtype=np.float32)
    cos = np.sum(ours * theirs, -1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))
    agree = ours.argmax(-1) == theirs.argmax(-1)
    print(f"positions {len(ids)}: cosine min {cos.min():.7f} mean {cos.mean():.7f}; "
          f"argmax agree {int(agree.sum())}/{len(ids)}; max |diff| {np.abs(ours - theirs).max():.2e} "
          f"(logit range {theirs.min():.1f}..{theirs.max():.1f})")

    ok = bool(cos.min() >= args.min_cos)
    for text, theirs_ids in zip(TEXTS, ref["tokenized"]):
        ours_ids = tok.encode(text).ids
        same = ours_ids == theirs_ids
        ok &= same
        print(f"tokenization {'same' if same else 'DIFFERENT'} ({len(ours_ids)} tokens): {text!r}")

    torch_greedy = model.greedy(prompt_ids, N_GREEDY)
    print(f"greedy torch    : {tok.decode(torch_greedy)!r}")
    print(f"greedy llama.cpp: {tok.decode(ref['greedy'])!r}")
    print(f"greedy token sequences {'identical' if torch_greedy == ref['greedy'] else 'DIFFER'}")
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
