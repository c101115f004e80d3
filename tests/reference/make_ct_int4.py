"""Writes tiny compressed-tensors `pack-quantized` Llama checkpoints made by the compressed-tensors
package itself, plus reference data for tests/reference_ct_int4.rs:

Under tests/reference/ct/:
  ct_int4_sym/    W4A16 (int4, symmetric, group 128), lm_head ignored
  ct_int4_asym/   W4A16_ASYM (int4, asymmetric with packed zero points, group 128)
  ct_mixed/       int8 channel-wise for the MLP, int4 group 64 for attention (two config groups,
                  `re:` targets), and layer 1's o_proj ignored by an `re:` pattern
  ct_int4_gidx/   int4 group 128 with `weight_g_idx` (GPTQ activation ordering)

Every weight is random bf16; qparams come from compressed-tensors' own calibrate-free min/max rule
(`calculate_qparams` on each group's min/max, as its memoryless observers compute), the packing from
`ModelCompressor.compress_model`, the files from `save_pretrained` + `ModelCompressor.update_config`.
For each checkpoint NAME/, NAME.reference.{json,safetensors} hold
  - compressed-tensors' own decompression (`PackedQuantizationCompressor.decompress`) of a few
    weights, as the bf16 bit patterns it returns and as f32 with the scale widened to f32 first
    (exact products): the bit-exact comparison targets;
  - transformers' logits running the quantized checkpoint (it decompresses on load).

compressed-tensors 0.20 removed activation ordering "group" (g_idx), so ct_int4_gidx is built by hand:
GPTQ's column permutation and group assignment, codes packed with compressed-tensors' `pack_to_int32`,
and the reference decompression is `(q - zp) * scale[o, g_idx[i]]` (the documented semantics);
transformers cannot load it, so it has no logits.

Run in the reference venv (compressed-tensors 0.20.x):
    .venv/bin/python tests/reference/make_ct_int4.py
"""
import json
import os
import shutil

import torch
import compressed_tensors
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             QuantizationStatus, apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "tiny_llama")
OUT = os.path.join(HERE, "ct")  # reuse its tokenizer and chat template
TEXTS = ["The quick brown fox", "def add(a, b):\n    return", "Numbers 0123 and !?"]
TEXTS = TEXTS[:2]
# Weights whose decompression the Rust test compares bit for bit (one group per row, and three).
CHECKED = ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"]


def tiny_model(seed):
    torch.manual_seed(seed)
    tok = PreTrainedTokenizerFast.from_pretrained(TOKENIZER_DIR)
    # Hidden sizes are multiples of 128 so group-128 quantization applies to every Linear.
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    return model.to(torch.bfloat16), tok


def calibrate_weights(model):
    """Sets weight_scale / weight_zero_point of every quantized Linear from its weight's min/max per
    group (or channel) with compressed-tensors' calculate_qparams: data-free W*A16 calibration."""
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args = scheme.weights
        w = m.weight.data.float()
        if args.strategy == "group":
            g = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            raise ValueError(args.strategy)
        scale, zp = calculate_qparams(lo, hi, args)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        m.weight_zero_point.data = zp.to(m.weight_zero_point.dtype).reshape(m.weight_zero_point.shape)
        m.quantization_status = QuantizationStatus.FROZEN


def decompress_reference(out_dir, qconfig, names):
    """compressed-tensors' own decompression of `names` from the saved checkpoint: bf16 bits as the
    library returns them, and f32 values with the scale widened first (exact (q - zp) * scale)."""
    tensors = {}
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out_dir, f)))
    ref = {}
    for name in names:
        scheme = scheme_for(qconfig, name)
        sd = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        if scheme is None or "weight_packed" not in sd:
            continue
        native = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
        wide = dict(sd, weight_scale=sd["weight_scale"].float())
        exact = PackedQuantizationCompressor.decompress(wide, scheme)["weight"]
        ref[name + ".native"] = native.contiguous()
        ref[name + ".f32"] = exact.float().contiguous()
    return ref


def scheme_for(qconfig, module_name):
    import re
    for ign in qconfig.ignore or []:
        if (ign.startswith("re:") and re.match(ign[3:], module_name)) or ign == module_name:
            return None
    for scheme in qconfig.config_groups.values():
        for t in scheme.targets:
            if t == "Linear" or t == module_name or (t.startswith("re:") and re.match(t[3:], module_name)):
                return scheme
    return None


def transformers_logits(out_dir, tok, qconfig, arrays):
    """Logits of transformers running the checkpoint. `dequantize=True` is transformers' own
    load-time decompression (bf16 weights, as the scales' dtype gives them); its compressed-module
    route cannot load asymmetric zero points (it expects them unpacked). `exact` swaps each
    quantized Linear's weight for compressed-tensors' decompression with f32 scales, i.e. the
    exact dequantised values, which is what the Rust engine multiplies with."""
    from transformers import CompressedTensorsConfig
    try:
        model, route = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval(), "compressed modules"
        with torch.no_grad():
            model(torch.tensor([[1, 2]]))  # MXFP4 modules decompress to bf16 and fail in an f32 model
    except RuntimeError:
        model = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
        route = "dequantize=True"
    tensors = {}
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out_dir, f)))
    cases = {"transformers": [], "exact": []}
    for variant in cases:
        if variant == "exact":
            for name, m in model.named_modules():
                scheme = scheme_for(qconfig, name)
                sd = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
                if isinstance(m, torch.nn.Linear) and scheme is not None and "weight_packed" in sd:
                    fmt = scheme.format or qconfig.format
                    if fmt == "pack-quantized":
                        sd["weight_scale"] = sd["weight_scale"].float()  # MX scales are exact powers of 2 already
                    compressor = BaseCompressor.get_value_from_registry(fmt)
                    m.weight.data = compressor.decompress(sd, scheme)["weight"].float()
        for text in TEXTS:
            ids = tok(text)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
            cases[variant].append({"text": text, "ids": ids})
            arrays[f"logits.{variant}.{len(cases[variant]) - 1}"] = logits.contiguous()
    return cases, route


def copy_tokenizer(out_dir):
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        shutil.copy(os.path.join(TOKENIZER_DIR, f), os.path.join(out_dir, f))


def write(out_dir, meta, arrays):
    """NAME.reference.json (metadata) and NAME.reference.safetensors (decompressed weights,
    logits) beside the checkpoint directory NAME, which must hold only the checkpoint."""
    base = out_dir + ".reference"
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    save_file(arrays, base + ".safetensors")
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"wrote {out_dir} ({total / 1024:.0f} KiB)")


def make_ct(name, seed, qconfig, ignore=None):
    out_dir = os.path.join(OUT, name)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    model, tok = tiny_model(seed)
    apply_quantization_config(model, qconfig)
    calibrate_weights(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(out_dir)
    if ignore is not None:
        # update_config writes the resolved module names; checkpoints in the wild (e.g. Kimi-K2)
        # keep `re:` patterns, so put the equivalent patterns back.
        path = os.path.join(out_dir, "config.json")
        cfg = json.load(open(path))
        cfg["quantization_config"]["ignore"] = ignore
        json.dump(cfg, open(path, "w"), indent=2, sort_keys=True)
    copy_tokenizer(out_dir)
    saved = json.load(open(os.path.join(out_dir, "config.json")))["quantization_config"]
    saved_cfg = QuantizationConfig.model_validate(saved)
    arrays = decompress_reference(out_dir, saved_cfg, CHECKED)
    cases, route = transformers_logits(out_dir, tok, saved_cfg, arrays)
    meta = {"compressed_tensors": compressed_tensors.__version__, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "transformers_route": route,
            "decompressed": CHECKED, "cases": cases["transformers"]}
    write(out_dir, meta, arrays)


def int_args(bits, symmetric, strategy, group_size=None):
    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)


def make_gidx(name, seed, group_size=128):
    """GPTQ-style activation ordering: columns are visited in a permuted order and consecutive
    visited columns share a group; g_idx[i] is the group of original column i."""
    out_dir = os.path.join(OUT, name)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    model, tok = tiny_model(seed)
    args = int_args(4, True, "group", group_size)
    q_min, q_max = -8, 7
    gen = torch.Generator().manual_seed(seed)
    state, ref = {}, {}
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    for n, p in model.state_dict().items():
        mod = n.rsplit(".", 1)[0]
        if mod not in linear:
            state[n] = p.contiguous()
            continue
        w = p.float()
        out_f, in_f = w.shape
        perm = torch.randperm(in_f, generator=gen)
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[perm] = (torch.arange(in_f) // group_size).to(torch.int32)
        groups = in_f // group_size
        scale = torch.empty(out_f, groups)
        for g in range(groups):
            cols = w[:, g_idx == g]
            s, _ = calculate_qparams(cols.amin(-1), cols.amax(-1), args)
            scale[:, g] = s
        scale = scale.to(torch.bfloat16)
        col_scale = scale.float()[:, g_idx.long()]
        q = torch.clamp(torch.round(w / col_scale), q_min, q_max).to(torch.int8)
        state[mod + ".weight_packed"] = pack_to_int32(q, 4)
        state[mod + ".weight_scale"] = scale
        state[mod + ".weight_shape"] = torch.tensor([out_f, in_f])
        state[mod + ".weight_g_idx"] = g_idx
        if mod in CHECKED:
            ref[mod + ".native"] = (q.to(torch.bfloat16) * scale[:, g_idx.long()]).contiguous()
            ref[mod + ".f32"] = (q.float() * col_scale).contiguous()
    os.makedirs(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                  "group_size": group_size, "actorder": "group", "dynamic": False}}},
        "ignore": ["lm_head"]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    copy_tokenizer(out_dir)
    write(out_dir, {"compressed_tensors": compressed_tensors.__version__, "decompressed": CHECKED, "cases": []}, ref)


def main():
    make_ct("ct_int4_sym", 1, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=int_args(4, True, "group", 128))},
        ignore=["lm_head"], format="pack-quantized"))
    make_ct("ct_int4_asym", 2, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=int_args(4, False, "group", 128))},
        ignore=["lm_head"], format="pack-quantized"))
    make_ct("ct_mixed", 3, QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(targets=["re:.*mlp\\.(gate|up|down)_proj$"], weights=int_args(8, True, "channel")),
            "group_1": QuantizationScheme(targets=["re:.*self_attn\\..*"], weights=int_args(4, True, "group", 64)),
        },
        ignore=["lm_head", "re:model\\.layers\\.1\\.self_attn\\.o_proj"], format="pack-quantized"),
        ignore=["re:.*lm_head", "re:.*layers\\.1\\.self_attn\\.o_proj$"])
    make_gidx("ct_int4_gidx", 4)


if __name__ == "__main__":
    main()
