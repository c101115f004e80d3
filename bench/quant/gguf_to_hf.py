"""Converts the default SmolLM2 GGUF (Q4_1) into a bf16 Hugging Face directory with transformers'
own GGUF reader (dequantised weights, converted tokenizer), the input for `wasmserve quantize`.

    .venv/bin/python bench/quant/gguf_to_hf.py models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2/bf16
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(gguf, out):
    d, f = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    print("wrote", out, sum(v.numel() for v in state.values()), "parameters")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
