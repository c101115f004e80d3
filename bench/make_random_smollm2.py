"""Writes a random-weight checkpoint with SmolLM2-135M's exact shapes (30 layers, hidden 576,
9 heads over 3 KV heads, intermediate 1536, vocabulary 49152, tied embeddings) in Hugging Face
layout (bf16 safetensors), plus transformers' reference logits for it.

For bench/gpu-check.sh on a GPU machine that cannot download the real model: decode speed
depends on the shapes, not the values, and the reference logits (transformers, f32 compute on
the same bf16 weights) check our device forward on the full-size model independently. The
tokenizer is the tiny fixture's (tests/reference/tiny_llama): prompts only use its 320 ids.

    python3 bench/make_random_smollm2.py OUT_DIR
"""
import json
import os
import shutil
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "..", "tests", "reference", "tiny_llama")
PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 77, 301, 12, 9, 180, 33], [1, 200, 45, 8]]
GREEDY_STEPS = 8


def main(out):
    torch.manual_seed(0)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, hidden_act="silu")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TOKENIZER_DIR, f), out)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)", file=sys.stderr)

    # Reference: f32 compute on the bf16 weights (what our engine computes on the CPU).
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = model.float().to(dev).eval()
    cases = []
    with torch.no_grad():
        for ids in PROMPTS:
            logits = ref(torch.tensor([ids], device=dev)).logits[0]
            seq, greedy, steps = list(ids), [], [logits[-1].tolist()]
            for k in range(GREEDY_STEPS):
                nxt = int(torch.tensor(steps[-1]).argmax())
                greedy.append(nxt)
                seq.append(nxt)
                if k + 1 < GREEDY_STEPS:
                    steps.append(ref(torch.tensor([seq], device=dev)).logits[0, -1].tolist())
            cases.append({"ids": ids, "prefill_logits": logits.tolist(), "greedy_ids": greedy, "step_logits": steps})
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"cases": cases}, f)
    print(f"wrote reference.json ({len(cases)} prompts, {GREEDY_STEPS} greedy steps, on {dev})", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models/random-smollm2-135m")
