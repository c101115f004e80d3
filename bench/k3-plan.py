#!/usr/bin/env python3
"""Header-only Kimi K3 checkpoints of the real sizes, for `wasmserve plan` (README's K3 figures).

No K3 weights can be downloaded here, and `plan` reads only config.json and safetensors headers,
so this writes, per published layout, K3's config (docs/formats.md §5.1: 93 layers, hidden 7168,
896 experts of 3072 in a 3584 latent, 69 KDA + 24 MLA layers, vocab 163840) and one header-only
shard per layer with every text tensor's real name, dtype and shape (§5.2), offsets laid out as if
the data followed (the files hold no data):

  int4   RedHatAI/Kimi-K3-INT4 as its issue describes it: compressed-tensors W4A16 g128 on every
         Linear but lm_head and the router gate (int32 codes [out, in/8], bf16 scales [out, in/128],
         int64 weight_shape).
  mxfp4  moonshotai/Kimi-K3: routed experts MXFP4 (U8 [out, in/2] + U8 E8M0 [out, in/32]), the rest bf16.
  cubic  QuantTrio/Kimi-K3-Cubic-2.5Bit: routed experts Cubic with the converter's default schedule
         1-3: W3 g256, 4-32: W3 g512, 33-91: W2 g512, 92: W4 g512 (U8 codes [out, ceil(in·b/8)],
         F32 scale, F16 a and b [out, in/g]); the rest bf16.

The vision tower is one placeholder tensor of 401M bf16 parameters (its size per the model card;
`plan` reports it as not served).

Usage: bench/k3-plan.py OUT_DIR   then   wasmserve plan --model OUT_DIR/<layout> --tensor-parallel-size 8
"""
import json
import math
import os
import struct
import sys

H, LAYERS, VOCAB, HEADS, HD = 7168, 93, 163840, 96, 128
DENSE_INTER, EXPERTS, MOE_INTER, LATENT, SHARED = 33792, 896, 3072, 3584, 2
Q_LORA, KV_LORA, NOPE, ROPE, V = 1536, 512, 128, 64, 128
FULL = [i for i in range(4, 93, 4)] + [93]
KDA = [i for i in range(1, 94) if i not in FULL]
CUBIC_SCHEDULE = [(1, 3, 3, 256), (4, 32, 3, 512), (33, 91, 2, 512), (92, 92, 4, 512)]
BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1}


def config(layout):
    text = {
        "model_type": "kimi_linear", "vocab_size": VOCAB, "hidden_size": H, "intermediate_size": DENSE_INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
        "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
        "v_head_dim": V, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": EXPERTS, "num_experts_per_token": 16, "num_shared_experts": SHARED,
        "moe_intermediate_size": MOE_INTER, "routed_expert_hidden_size": LATENT, "latent_moe_use_norm": True,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "attn_res_block_size": 12, "num_nextn_predict_layers": 0,
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "linear_attn_config": {"kda_layers": KDA, "full_attn_layers": FULL, "num_heads": HEADS, "head_dim": HD,
                               "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    }
    if layout == "int4":
        q = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}},
             "ignore": ["language_model.lm_head", "re:.*block_sparse_moe\\.gate$", "re:.*vision_tower.*",
                        "re:.*mm_projector.*"]}
    elif layout == "mxfp4":
        q = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                 "scale_dtype": "torch.uint8"}}},
             "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                        "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}
    else:
        q = {"quant_method": "cubic", "format": "cubic-pack-quantized", "config_groups": {
            f"moe_layers_{s}_{e}": {"targets": [f"re:.*\\.layers\\.(?:{'|'.join(str(i) for i in range(s, e + 1))})\\.block_sparse_moe\\.experts"],
                                    "weights": {"num_bits": b, "group_size": g}} for s, e, b, g in CUBIC_SCHEDULE},
             "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                        "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}
    text["quantization_config"] = q
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "media_placeholder_token_id": 163605, "text_config": text, "vision_config": {"model_type": "kimi_k3_vision"}}


def linear(layout, name, out, inp, expert_layer=None, int4=True):
    """The tensors of Linear `name` in `layout`: (name, dtype, shape) triples."""
    if layout == "int4" and int4 and inp % 128 == 0:
        return [(f"{name}.weight_packed", "I32", [out, inp // 8]), (f"{name}.weight_scale", "BF16", [out, inp // 128]),
                (f"{name}.weight_shape", "I64", [2])]
    if expert_layer is not None and layout == "mxfp4":
        return [(f"{name}.weight_packed", "U8", [out, inp // 2]), (f"{name}.weight_scale", "U8", [out, inp // 32])]
    if expert_layer is not None and layout == "cubic":
        b, g = next((b, g) for s, e, b, g in CUBIC_SCHEDULE if s <= expert_layer <= e)
        return [(f"{name}.weight_packed", "U8", [out, math.ceil(inp * b / 8)]),
                (f"{name}.weight_scale", "F32", [out, inp // g]), (f"{name}.weight_a", "F16", [out, inp // g]),
                (f"{name}.weight_b", "F16", [out, inp // g])]
    return [(f"{name}.weight", "BF16", [out, inp])]


def layer_tensors(layout, i):
    p = f"language_model.model.layers.{i}"
    t = []
    for side in ["self_attention_res", "mlp_res"]:
        t.append((f"{p}.{side}_norm.weight", "BF16", [H]))
        t += linear(layout, f"{p}.{side}_proj", 1, H)
    t += [(f"{p}.input_layernorm.weight", "BF16", [H]), (f"{p}.post_attention_layernorm.weight", "BF16", [H])]
    a = f"{p}.self_attn"
    if (i + 1) in KDA:
        P = HEADS * HD
        for x in "qkv":
            t += linear(layout, f"{a}.{x}_proj", P, H)
            t.append((f"{a}.{x}_conv1d.weight", "F32", [P, 1, 4]))
        t += linear(layout, f"{a}.f_a_proj", HD, H) + linear(layout, f"{a}.f_b_proj", P, HD)
        t += [(f"{a}.A_log", "F32", [HD]), (f"{a}.dt_bias", "F32", [P])]
        t += linear(layout, f"{a}.b_proj", HEADS, H) + linear(layout, f"{a}.g_proj", P, H)
        t += [(f"{a}.o_norm.weight", "F32", [HD])] + linear(layout, f"{a}.o_proj", H, P)
    else:
        t += linear(layout, f"{a}.q_a_proj", Q_LORA, H) + [(f"{a}.q_a_layernorm.weight", "BF16", [Q_LORA])]
        t += linear(layout, f"{a}.q_b_proj", HEADS * (NOPE + ROPE), Q_LORA)
        t += linear(layout, f"{a}.kv_a_proj_with_mqa", KV_LORA + ROPE, H)
        t += [(f"{a}.kv_a_layernorm.weight", "BF16", [KV_LORA])]
        t += linear(layout, f"{a}.kv_b_proj", HEADS * (NOPE + V), KV_LORA)
        t += linear(layout, f"{a}.g_proj", HEADS * V, H) + linear(layout, f"{a}.o_proj", H, HEADS * V)
    if i == 0:
        t += linear(layout, f"{p}.mlp.gate_proj", DENSE_INTER, H) + linear(layout, f"{p}.mlp.up_proj", DENSE_INTER, H)
        t += linear(layout, f"{p}.mlp.down_proj", H, DENSE_INTER)
    else:
        m = f"{p}.block_sparse_moe"
        t += [(f"{m}.gate.weight", "BF16", [EXPERTS, H]), (f"{m}.gate.e_score_correction_bias", "F32", [EXPERTS])]
        t += linear(layout, f"{m}.routed_expert_down_proj", LATENT, H) + [(f"{m}.routed_expert_norm.weight", "BF16", [LATENT])]
        t += linear(layout, f"{m}.routed_expert_up_proj", H, LATENT)
        for leaf in ["gate_proj", "up_proj"]:
            t += linear(layout, f"{m}.shared_experts.{leaf}", MOE_INTER * SHARED, H)
        t += linear(layout, f"{m}.shared_experts.down_proj", H, MOE_INTER * SHARED)
        for e in range(EXPERTS):
            for leaf, out, inp in [("w1", MOE_INTER, LATENT), ("w3", MOE_INTER, LATENT), ("w2", LATENT, MOE_INTER)]:
                t += linear(layout, f"{m}.experts.{e}.{leaf}", out, inp, expert_layer=i)
    return t


def write_shard(path, tensors):
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        n = BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "k3-headers"
    for layout in ["int4", "mxfp4", "cubic"]:
        d = os.path.join(out, layout)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config(layout), f, indent=1)
        weight_map = {}
        shards = [("model", [("language_model.model.embed_tokens.weight", "BF16", [VOCAB, H]),
                             ("language_model.model.norm.weight", "BF16", [H]),
                             ("language_model.model.output_attn_res_norm.weight", "BF16", [H])]
                   + linear(layout, "language_model.model.output_attn_res_proj", 1, H)
                   + [("language_model.lm_head.weight", "BF16", [VOCAB, H]),
                      ("vision_tower.placeholder", "BF16", [401_000_000])])]
        shards += [(f"layer{i:02d}", layer_tensors(layout, i)) for i in range(LAYERS)]
        for stem, tensors in shards:
            fname = f"{stem}.safetensors"
            write_shard(os.path.join(d, fname), tensors)
            weight_map.update({name: fname for name, _, _ in tensors})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": weight_map}, f)
        print(f"{d}: {len(weight_map)} tensors", file=sys.stderr)


if __name__ == "__main__":
    main()
