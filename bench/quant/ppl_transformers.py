"""Independent perplexity of a model directory or GGUF with transformers (float32 compute), on the
same windows as `wasmserve bench perplexity`: the text tokenized without special tokens, cut into
non-overlapping windows of CTX tokens from the start, every token after a window's first predicted
from the window's earlier tokens.

    .venv/bin/python bench/quant/ppl_transformers.py MODEL_DIR_OR_GGUF TEXT [CTX] [WINDOWS]
"""
import math
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def load(path):
    if path.endswith(".gguf"):
        d, f = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(d, gguf_file=f), AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def main(path, text, ctx=512, windows=4):
    tok, model = load(path)
    ids = tok(open(text, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in range(min(windows, len(ids) // ctx)):
            x = torch.tensor([ids[w * ctx:(w + 1) * ctx]])
            logp = torch.log_softmax(model(x).logits[0, :-1].double(), dim=-1)
            nll -= logp.gather(1, x[0, 1:, None]).sum().item()
            n += ctx - 1
    print(f"{path}\t{n} tokens\tppl {math.exp(nll / n):.4f}\t(transformers)")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], *(int(v) for v in a[2:]))
