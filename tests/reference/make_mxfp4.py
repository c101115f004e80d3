"""MXFP4 fixtures encoded by independent encoders, for tests/reference_mxfp4.rs.

  ct/ct_mxfp4/   a tiny Llama whose MLP Linears compressed-tensors itself quantized to MXFP4
                 (its MXFP4A16 preset: E2M1 codes, E8M0 scale per 32 inputs, format
                 mxfp4-pack-quantized; attention and lm_head stay bf16). Reference: compressed-
                 tensors' own decompression of two weights and transformers' logits.
  ct/gpt_oss_blocks.safetensors
                 one of those weights re-laid out as a gpt-oss expert tensor (`*_blocks`
                 [E, rows, in/32, 16], `*_scales` [E, rows, in/32]) with E = 2 (expert 1 is the
                 weight negated bit-wise in the sign nibble), and transformers' own gpt-oss
                 decoder (`integrations.mxfp4._convert_moe_packed_tensors`) output as reference.

Run in the reference venv:  .venv/bin/python tests/reference/make_mxfp4.py
"""
import json
import os
import shutil
import sys

import torch
import compressed_tensors
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
from compressed_tensors.quantization.quant_scheme import MXFP4A16
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.quantization import QuantizationStatus
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_ct_int4 import OUT, copy_tokenizer, tiny_model, transformers_logits  # noqa: E402

CHECKED = ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.down_proj"]


def calibrate(model):
    """Per-group absmax → E8M0 scale with compressed-tensors' calculate_qparams (data-free)."""
    for _, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w = m.weight.data.float()
        g = w.unflatten(-1, (w.shape[-1] // 32, 32))
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        m.quantization_status = QuantizationStatus.FROZEN


def main():
    out_dir = os.path.join(OUT, "ct_mxfp4")
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    model, tok = tiny_model(5)
    qcfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["re:.*mlp\\..*_proj$"], **MXFP4A16)},
                              ignore=["lm_head"], format="mxfp4-pack-quantized")
    apply_quantization_config(model, qcfg)
    calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(out_dir)
    copy_tokenizer(out_dir)
    saved = QuantizationConfig.model_validate(json.load(open(os.path.join(out_dir, "config.json")))["quantization_config"])
    scheme = saved.config_groups["group_0"]
    tensors = load_file(os.path.join(out_dir, "model.safetensors"))
    arrays = {}
    for name in CHECKED:
        sd = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        arrays[name + ".native"] = MXFP4PackedCompressor.decompress(sd, scheme)["weight"].contiguous()
    cases, route = transformers_logits(out_dir, tok, saved, arrays)
    meta = {"compressed_tensors": compressed_tensors.__version__, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "transformers_route": route,
            "decompressed": CHECKED, "cases": cases["transformers"]}
    with open(out_dir + ".reference.json", "w") as f:
        json.dump(meta, f, indent=1)
    save_file(arrays, out_dir + ".reference.safetensors")

    # gpt-oss layout of the same bytes: blocks [E, rows, in/32, 16] and scales [E, rows, in/32].
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors
    name = CHECKED[1]
    packed, scales = tensors[name + ".weight_packed"], tensors[name + ".weight_scale"]
    rows, half = packed.shape
    blocks = packed.reshape(rows, half // 16, 16)
    blocks = torch.stack([blocks, blocks ^ 0x88])  # expert 1: every code's sign flipped
    scales = torch.stack([scales, scales + 1])     # ... and scaled by 2
    dense = _convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, rows]
    save_file({"experts.down_proj_blocks": blocks.contiguous(), "experts.down_proj_scales": scales.contiguous(),
               "reference.dequantized": dense.contiguous()},
              os.path.join(OUT, "gpt_oss_blocks.safetensors"))
    print("wrote", out_dir, "and gpt_oss_blocks.safetensors; transformers route:", route)


if __name__ == "__main__":
    main()
