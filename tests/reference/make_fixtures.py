"""Reference fixtures for the default model, from transformers loading the same GGUF file.

transformers dequantises the GGUF with gguf-py and runs LlamaForCausalLM in float32; its
tokenizer is converted from the GGUF metadata by transformers itself. Writes
tests/reference/smollm2/fixtures.json plus the full last-position logits of each prompt as
little-endian float32 files. Run in the reference venv (scripts/setup-reference-venv):
    .venv/bin/python tests/reference/make_fixtures.py
"""
import hashlib
import importlib.metadata
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(ROOT, "models")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
OUT = os.path.join(ROOT, "tests", "reference", "smollm2")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because it wanted to see the river.",
    "Price: $1234.56 — naïve café\n\n  indented   text 😀 and 42 numbers, 3.14159!",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
]

TOKENIZER_CASES = [
    "", " ", "  ", "   leading spaces", "trailing spaces   ", "\n", "\n\n\n", "\t", "\ttabbed\tline",
    "1234567890", "3.14159", "1,000,000", "I'm can't we'll they've she'd", "HELLO World",
    "你好世界", "こんにちは", "Привет мир", "emoji 😀🎉👍🏽", "naïve café résumé",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "a<|im_end|>b",
    "supercalifragilisticexpialidocious", "!!!???...,,,;;;", "---===+++", "(parens) [brackets] {braces}",
    "https://example.com/path?q=1&r=2", "user@example.com", "C:\\Windows\\System32",
    "x = y + z * 2 ** 8", "if (a && b || !c) { return; }", "    four spaces", "mixed\r\nline endings\r\n",
    "Hello, world! How are you today?", " a b c d e f g", "ÄÖÜ äöü ß", "0x1F 0b1010 1e-5",
    "multiple     spaces     between", "end with newline\n", "¿Qué tal? ¡Bien!",
]

PROBE_IDS = list(range(0, 49152, 768))


def greedy_margins(model, ids, gen):
    """Top-1 minus top-2 logit at each generated step (re-run without the KV cache): how close
    each greedy choice was, so a test can tell a real mismatch from a near-tie flip."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + gen])).logits[0][len(ids) - 1:len(ids) - 1 + len(gen)]
    top2 = torch.topk(logits, 2).values
    assert logits.argmax(-1).tolist() == gen, "greedy ids differ from a full-sequence argmax"
    return [float(a - b) for a, b in top2]


def progress(msg):
    print(f"make_fixtures: {msg}", file=sys.stderr, flush=True)


def main():
    torch.manual_seed(0)
    path = os.path.join(MODEL_DIR, MODEL_FILE)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert digest == SHA256, f"{path}: sha256 {digest}, run scripts/fetch-default-model"
    progress("loading tokenizer and model through transformers' GGUF loader")
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE, dtype=torch.float32).eval()
    os.makedirs(OUT, exist_ok=True)
    backend = json.loads(tok.backend_tokenizer.to_str())
    for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        progress(f"tokenizer {k}: {json.dumps(backend[k], ensure_ascii=False)}")

    out = {
        "model_file": MODEL_FILE,
        "model_sha256": SHA256,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     **{p: importlib.metadata.version(p) for p in ("tokenizers", "gguf", "numpy")}},
        "add_special_tokens_default": tok("x")["input_ids"] != tok("x", add_special_tokens=False)["input_ids"],
        "special_tokens": {"bos": [tok.bos_token, tok.bos_token_id], "eos": [tok.eos_token, tok.eos_token_id],
                           "pad": [tok.pad_token, tok.pad_token_id], "unk": [tok.unk_token, tok.unk_token_id]},
        "chat_template": tok.chat_template,
        "pre_tokenizer": backend["pre_tokenizer"],
        # The rest of the converted fast tokenizer's pipeline, as tokenizers serialises it.
        "tokenizer_pipeline": {k: backend[k] for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder")}
        | {"model_type": backend["model"]["type"],
           "model_options": {k: v for k, v in backend["model"].items() if k not in ("vocab", "merges")},
           "added_tokens": backend["added_tokens"]},
        "greedy_note": "32 new tokens with min_new_tokens=32 so EOS cannot end them early",
        "prompts": [],
    }
    for i, text in enumerate(PROMPTS):
        progress(f"prompt {i}")
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
            gen = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0][len(ids):].tolist()
        top = []
        for row in logits:
            v, idx = torch.topk(row, 16)
            top.append([[int(a), float(b)] for a, b in zip(idx, v)])
        last_file = f"prompt{i}_last.f32"
        logits[-1].numpy().astype("<f4").tofile(os.path.join(OUT, last_file))
        out["prompts"].append({
            "text": text, "ids": ids, "logits_top": top, "logits_probe_ids": PROBE_IDS,
            "logits_probe": [[float(row[j]) for j in PROBE_IDS] for row in logits],
            "last_logits_file": last_file, "greedy_ids": gen, "greedy_text": tok.decode(gen),
            "greedy_margins": greedy_margins(model, ids, gen),
        })

    progress("chat")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0][len(ids):].tolist()
    stopped = bool(gen) and gen[-1] == tok.eos_token_id
    if stopped:
        gen = gen[:-1]
    out["chat"] = {"messages": messages, "prompt": prompt, "ids": ids, "greedy_ids": gen,
                   "greedy_text": tok.decode(gen, skip_special_tokens=True),
                   # greedy_ids excludes the EOS token that ended generation, when one did.
                   "stopped_at_eos": stopped, "greedy_margins": greedy_margins(model, ids, gen)}
    assert "Paris" in out["chat"]["greedy_text"], out["chat"]["greedy_text"]
    progress(f"chat answer: {out['chat']['greedy_text']!r}")
    out["tokenizer_cases"] = [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TOKENIZER_CASES]
    with open(os.path.join(OUT, "fixtures.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False)
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    progress(f"wrote {OUT} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
