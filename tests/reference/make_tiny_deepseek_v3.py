"""DeepSeek-V3 / MLA reference fixtures computed by transformers.

Writes tests/reference/deepseek_v3/:
  model/  a tiny random-weight DeepseekV3ForCausalLM (MLA with q_lora, YaRN rope scaling with
      factor 4 and distinct mscale / mscale_all_dim, interleaved rope, 1 dense + 3 MoE layers with
      grouped noaux_tc routing and a shared expert), bf16 safetensors (the reference runs in f32
      on exactly those bf16-rounded weights), the tiny_llama tokenizer, and reference.json with
      prefill logits and 32 greedy decode steps (each step's full logits) per prompt.
  mla_gated.safetensors + mla_gated.json  single gated-MLA layers: transformers' own attention
      module with the output gate `o = o * sigmoid(g_proj(x))` added before o_proj (a forward
      pre-hook on o_proj — transformers has no gated MLA; the gate is assumed as Kimi K3's,
      docs/formats.md §5.6):
        dsv3_gated: DeepseekV3Attention (q_lora, YaRN, interleaved rope) + gate
        kimi_gated: KimiLinearAttention (NoPE, plain q_proj) + gate
      inputs [T, hidden], causal whole-prompt outputs.

Run: .venv/bin/python tests/reference/make_tiny_deepseek_v3.py
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, KimiLinearConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "deepseek_v3")
TOKENIZER_FROM = os.path.join(HERE, "tiny_llama")

ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def dsv3_config(num_layers=4):
    return DeepseekV3Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        rms_norm_eps=1e-5, max_position_embeddings=256, rope_parameters=dict(ROPE), rope_interleave=True,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attn_implementation="eager",
    )


def randomize(module, std=0.2):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight") and "proj" not in name:
                p.normal_(0.0, 0.5)  # router: spread the expert scores
            else:
                p.normal_(0.0, std)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)


def bf16_round(module):
    """Round every weight to bf16 (what the checkpoint stores) so the f32 reference runs on the same values."""
    with torch.no_grad():
        for p in list(module.parameters()) + [b for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")]:
            p.copy_(p.to(torch.bfloat16).float())


def make_model():
    cfg = dsv3_config()
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    randomize(model)
    bf16_round(model)
    d = os.path.join(OUT, "model")
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        shutil.copy(os.path.join(TOKENIZER_FROM, f), os.path.join(d, f))
    ref, info = DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info
    ref = ref.eval()
    g = torch.Generator().manual_seed(7)
    cases = []
    # 40 + 32 positions run past original_max_position_embeddings (32): YaRN's scaled range.
    for length in [9, 40]:
        ids = torch.randint(3, cfg.vocab_size, (1, length), generator=g)
        with torch.no_grad():
            prefill = ref(ids).logits[0]
            out = ref.generate(ids, max_new_tokens=32, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, use_cache=True, eos_token_id=None, pad_token_id=0)
        greedy = out.sequences[0, length:].tolist()
        steps = torch.stack(out.logits, dim=0)[:, 0]  # [32, vocab], step 0 = last prefill position
        top2 = steps.topk(2, dim=-1).values
        r = lambda t: [[round(x, 5) for x in row] for row in t.tolist()]
        cases.append({"ids": ids[0].tolist(), "prefill_logits": r(prefill), "greedy_ids": greedy,
                      "step_logits": r(steps), "min_greedy_margin": float((top2[:, 0] - top2[:, 1]).min())})
        print(f"case len {length}: greedy {greedy[:8]}..., min margin {cases[-1]['min_greedy_margin']:.4f}, "
              f"max |logit| {float(steps.abs().max()):.2f}")
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump({"transformers": __import__("transformers").__version__, "torch": torch.__version__,
                   "vocab_size": cfg.vocab_size, "cases": cases}, f)


def causal_mask(t):
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


def gated(attn, hidden):
    """Adds the output gate `o * sigmoid(g_proj(x))` in front of attn.o_proj."""
    heads_v = attn.num_heads * attn.v_head_dim
    attn.g_proj = torch.nn.Linear(hidden, heads_v, bias=False)
    state = {}
    attn.o_proj.register_forward_pre_hook(lambda mod, args: (args[0] * torch.sigmoid(attn.g_proj(state["x"])),))
    return state


def make_gated():
    tensors, meta = {}, {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "cases": {}}
    torch.manual_seed(1)
    # DeepSeek-V3 MLA with YaRN + gate.
    cfg = dsv3_config(1)
    attn = DeepseekV3Attention(cfg, 0).float().eval()
    state = gated(attn, cfg.hidden_size)
    randomize(attn, std=0.25)
    rot = DeepseekV3RotaryEmbedding(cfg)
    x = torch.randn(1, 50, cfg.hidden_size)
    with torch.no_grad():
        state["x"] = x
        pe = rot(x, torch.arange(50)[None])
        y = attn(x, pe, causal_mask(50))[0]
    tensors.update({f"dsv3_gated.self_attn.{k}": v.float().contiguous() for k, v in attn.state_dict().items()})
    tensors["dsv3_gated.input"], tensors["dsv3_gated.output"] = x[0].contiguous(), y[0].contiguous()
    cfg_json = json.loads(cfg.to_json_string())
    cfg_json["mla_use_output_gate"] = True
    meta["cases"]["dsv3_gated"] = {"config": cfg_json, "len": 50}
    # Kimi NoPE MLA + gate.
    kc = KimiLinearConfig(vocab_size=320, hidden_size=48, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=None,
                          kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_hidden_layers=1,
                          attn_implementation="eager",
                          linear_attn_config={"kda_layers": [], "full_attn_layers": [1], "num_heads": 3, "head_dim": 16,
                                              "short_conv_kernel_size": 4})
    attn = KimiLinearAttention(kc, 0).float().eval()
    state = gated(attn, kc.hidden_size)
    randomize(attn, std=0.25)
    x = torch.randn(1, 30, kc.hidden_size)
    with torch.no_grad():
        state["x"] = x
        y = attn(x, causal_mask(30))[0]
    tensors.update({f"kimi_gated.self_attn.{k}": v.float().contiguous() for k, v in attn.state_dict().items()})
    tensors["kimi_gated.input"], tensors["kimi_gated.output"] = x[0].contiguous(), y[0].contiguous()
    kj = json.loads(kc.to_json_string())
    kj.update({"mla_use_nope": True, "mla_use_output_gate": True})
    meta["cases"]["kimi_gated"] = {"config": kj, "len": 30}
    # The gate must matter: compare against the ungated output.
    save_file(tensors, os.path.join(OUT, "mla_gated.safetensors"))
    with open(os.path.join(OUT, "mla_gated.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def main():
    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    make_model()
    make_gated()
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(OUT) for f in fs)
    print(f"fixtures: {total / 1e6:.2f} MB")
    assert total < 1e6


if __name__ == "__main__":
    main()
