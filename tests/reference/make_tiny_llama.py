"""Writes a tiny random-weight Llama checkpoint in Hugging Face layout (bf16, two safetensors
shards with an index, tokenizer.json, chat template) plus transformers' reference logits.

The Rust test `tests/reference_tiny_llama.rs` loads the same directory through the safetensors
path and must match these logits. Run in the reference venv (scripts/setup-reference-venv):
    .venv/bin/python tests/reference/make_tiny_llama.py
"""
import json
import os
import shutil

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_llama")
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a tiny language model that lived in a test fixture.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0123456789 and punctuation !?.,;: appear here.",
] * 20


def main():
    torch.manual_seed(0)
    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    print("training a tiny byte-level BPE tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    vocab = tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    fast.save_pretrained(OUT)

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.to(torch.bfloat16)
    model.save_pretrained(OUT, max_shard_size="150KB", safe_serialization=True)
    shards = sorted(f for f in os.listdir(OUT) if f.endswith(".safetensors"))
    print("shards:", shards)
    assert len(shards) >= 2, "want a sharded checkpoint"

    # Reference: transformers in float32 on the bf16 weights (what our loader computes with).
    ref = LlamaForCausalLM.from_pretrained(OUT, torch_dtype=torch.float32).eval()
    cases = []
    for text in ["The quick brown fox", "def add(a, b):\n    return", "Numbers 0123 and !?"]:
        ids = fast(text)["input_ids"]
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0]
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                               pad_token_id=0)[0][len(ids):].tolist()
        cases.append({"text": text, "ids": ids, "logits": [[round(float(v), 6) for v in row] for row in logits],
                      "greedy_ids": gen})
    meta = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__, "vocab_size": vocab, "cases": cases}
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(meta, f)
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote {OUT} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
