"""Kimi Delta Attention / Kimi-Linear reference fixtures, computed by transformers' own pure-PyTorch
KDA path (no fla-core).

Writes tests/reference/kimi_linear/:
  kda_layers.safetensors + kda_layers.json  single KDA layers (weights under original checkpoint
      names `<case>.self_attn.*`, inputs, transformers outputs) for two variants:
        kimi_linear: softplus forget gate, low-rank output gate (KimiLinearDeltaAttention)
        k3:          lower-bound forget gate (Glm5NextTextForgetGate, linear_lower_bound=-5) and a
                     full-rank output gate `g_proj` (K3's `use_full_rank_gate`)
      Each case has a whole-prompt output (transformers' chunked path) and outputs of a prefill
      followed by token-by-token decode through transformers' cache (its recurrent path).
  model/  a tiny random-weight KimiLinearForCausalLM (KDA layers 1,2,4 and an MLA layer 3,
      dense first layer, MoE with shared experts), config.json in the original checkpoint form
      (`linear_attn_config` with 1-based layer lists), safetensors, tokenizer, and reference.json
      with prefill logits and 32 greedy decode steps (each step's full logits).

Run: .venv/bin/python tests/reference/make_tiny_kimi_linear.py
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "kimi_linear")
TOKENIZER_FROM = os.path.join(HERE, "tiny_llama")

HIDDEN = 48
HEADS = 3
HEAD_DIM = 16
P = HEADS * HEAD_DIM


def kda_config(num_layers=1):
    return KimiLinearConfig(
        vocab_size=320, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.7,
        n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256,
        linear_attn_config={"kda_layers": [1, 2, 4][:num_layers] if num_layers > 1 else [1],
                            "full_attn_layers": [3] if num_layers > 1 else [],
                            "num_heads": HEADS, "head_dim": HEAD_DIM, "short_conv_kernel_size": 4},
        first_k_dense_replace=1,
    )


def randomize(module, std=0.25):
    """Large enough weights that every part of the layer changes the output measurably; the decay
    parameters (A_log, dt_bias) keep transformers' (FLA's) initialisation, so decays stay realistic."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log") or name.endswith("dt_bias"):
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "conv1d" in name:
                p.normal_(0.0, 0.4)
            elif "gate.weight" in name and p.dim() == 2 and "proj" not in name:
                p.normal_(0.0, 0.5)  # router: spread the expert scores
            else:
                p.normal_(0.0, std)


def original_kda_names(layer, prefix, full_rank_gate):
    """The layer's weights under the names Moonshot's checkpoints use (transformers renames them on
    load: forget_gate.* and the concatenated conv1d)."""
    sd = {k: v.detach().float().contiguous() for k, v in layer.state_dict().items()}
    out = {}
    for k in ["q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "o_proj.weight", "o_norm.weight"]:
        out[f"{prefix}.{k}"] = sd[k]
    conv = sd["conv1d.weight"]  # [3P, 1, K]
    out[f"{prefix}.q_conv1d.weight"] = conv[:P].contiguous()
    out[f"{prefix}.k_conv1d.weight"] = conv[P:2 * P].contiguous()
    out[f"{prefix}.v_conv1d.weight"] = conv[2 * P:].contiguous()
    out[f"{prefix}.f_a_proj.weight"] = sd["forget_gate.f_a_proj.weight"]
    out[f"{prefix}.f_b_proj.weight"] = sd["forget_gate.f_b_proj.weight"]
    out[f"{prefix}.dt_bias"] = sd["forget_gate.dt_bias"]
    out[f"{prefix}.A_log"] = sd["forget_gate.A_log"]
    if full_rank_gate:
        out[f"{prefix}.g_proj.weight"] = sd["g_b_proj.weight"]
    else:
        out[f"{prefix}.g_a_proj.weight"] = sd["g_a_proj.weight"]
        out[f"{prefix}.g_b_proj.weight"] = sd["g_b_proj.weight"]
    return out


def make_kda_case(name, lower_bound, full_rank_gate):
    cfg = kda_config(1)
    layer = KimiLinearDeltaAttention(cfg, 0).float().eval()
    if lower_bound is not None:
        # GLM-5-Next's forget gate is KDA's with the "safe" lower-bound gate lb·sigmoid(exp(A_log)·(f+dt_bias)).
        class LbCfg:
            linear_head_dim, linear_num_heads, hidden_size, linear_lower_bound = HEAD_DIM, HEADS, HIDDEN, lower_bound
        layer.forget_gate = Glm5NextTextForgetGate(LbCfg())
        with torch.no_grad():
            layer.forget_gate.A_log.copy_(torch.randn(HEADS) * 0.5)
            layer.forget_gate.dt_bias.copy_(torch.randn(P) * 0.5)
    if full_rank_gate:
        # Full-rank output gate g_proj(x): the low-rank pair with an identity first factor.
        layer.g_a_proj = torch.nn.Identity()
        layer.g_b_proj = torch.nn.Linear(HIDDEN, P, bias=False)
    with torch.no_grad():
        if lower_bound is None:
            a = torch.empty(1, 1, HEADS, 1).uniform_(1.0, 16.0).log()
            layer.forget_gate.A_log.copy_(a)
            dt = torch.empty(P).uniform_(-6.9, -2.3).exp().clamp_min(1e-4)
            layer.forget_gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    randomize(layer)
    layer = layer.float().eval()
    tensors = original_kda_names(layer, f"{name}.self_attn", full_rank_gate)

    seqs = []
    for si, length in enumerate([70, 9]):  # 70 > transformers' 64-token chunk: two chunks
        x = torch.randn(1, length, HIDDEN)
        with torch.no_grad():
            whole = layer(x)
            # Prefill part of it, then decode token by token through transformers' cache.
            split = 5 if length < 20 else 37
            cache = DynamicCache(config=kda_config(1))
            parts = [layer(x[:, :split], cache=cache)]
            for t in range(split, length):
                parts.append(layer(x[:, t:t + 1], cache=cache))
            stepped = torch.cat(parts, dim=1)
        tensors[f"{name}.input.{si}"] = x[0].contiguous()
        tensors[f"{name}.output.{si}"] = whole[0].contiguous()
        tensors[f"{name}.stepped.{si}"] = stepped[0].contiguous()
        seqs.append({"len": length, "split": split,
                     "max_abs_output": float(whole.abs().max()),
                     "whole_vs_stepped": float((whole - stepped).abs().max())})
    meta = {"hidden_size": HIDDEN, "num_heads": HEADS, "head_dim": HEAD_DIM, "conv_kernel": 4,
            "rms_norm_eps": cfg.rms_norm_eps, "gate_lower_bound": lower_bound,
            "use_full_rank_gate": full_rank_gate, "sequences": seqs}
    return tensors, meta


def make_model():
    cfg = kda_config(4)
    assert cfg.layer_types == ["linear_attention", "linear_attention", "full_attention", "linear_attention"], cfg.layer_types
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"], cfg.mlp_layer_types
    model = KimiLinearForCausalLM(cfg).float().eval()
    randomize(model, std=0.2)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    d = os.path.join(OUT, "model")
    model.save_pretrained(d, safe_serialization=True)
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        shutil.copy(os.path.join(TOKENIZER_FROM, f), os.path.join(d, f))
    # config.json as Moonshot's checkpoints write it: the layer plan only in linear_attn_config.
    with open(os.path.join(d, "config.json")) as f:
        conf = json.load(f)
    for k in ["layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"]:
        conf.pop(k, None)
    conf["linear_attn_config"] = {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": HEADS,
                                  "head_dim": HEAD_DIM, "short_conv_kernel_size": 4}
    conf["first_k_dense_replace"] = 1
    conf["mla_use_nope"] = True
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)

    # transformers writes the dense layer-0 MLP as `block_sparse_moe.*` (its rename of `.mlp.` run
    # backwards); Moonshot's checkpoints name it `mlp.*`, which transformers also loads.
    st = os.path.join(d, "model.safetensors")
    from safetensors.torch import load_file
    sd = load_file(st)
    sd = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in sd.items()}
    save_file(sd, st, metadata={"format": "pt"})
    ref, info = KimiLinearForCausalLM.from_pretrained(d, torch_dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ref = ref.eval()
    # The re-read config must give the same plan (so the reference is of what we ship).
    assert ref.config.layer_types == cfg.layer_types and ref.config.mlp_layer_types == cfg.mlp_layer_types
    g = torch.Generator().manual_seed(7)
    cases = []
    for length in [11, 23, 5]:
        ids = torch.randint(3, cfg.vocab_size, (1, length), generator=g)
        with torch.no_grad():
            prefill = ref(ids).logits[0]
            out = ref.generate(ids, max_new_tokens=32, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, use_cache=True, eos_token_id=None, pad_token_id=0)
        greedy = out.sequences[0, length:].tolist()
        steps = torch.stack(out.logits, dim=0)[:, 0]  # [32, vocab], step 0 = last prefill position
        top2 = steps.topk(2, dim=-1).values
        r = lambda t: [[round(x, 5) for x in row] for row in t.tolist()]  # 1e-5 keeps the file small
        cases.append({"ids": ids[0].tolist(), "prefill_logits": r(prefill), "greedy_ids": greedy,
                      "step_logits": r(steps), "min_greedy_margin": float((top2[:, 0] - top2[:, 1]).min())})
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump({"transformers": __import__("transformers").__version__, "torch": torch.__version__,
                   "vocab_size": cfg.vocab_size, "cases": cases}, f)
    print("model tensors:", sorted(k for k in __import__("safetensors").safe_open(
        os.path.join(d, "model.safetensors"), "pt").keys() if ".layers.0." in k or ".layers.2." in k))


def main():
    torch.manual_seed(0)
    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    tensors, meta = {}, {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "cases": {}}
    for name, lb, full in [("kimi_linear", None, False), ("k3", -5.0, True)]:
        t, m = make_kda_case(name, lb, full)
        tensors.update(t)
        meta["cases"][name] = m
        print(name, m)
    save_file(tensors, os.path.join(OUT, "kda_layers.safetensors"))
    with open(os.path.join(OUT, "kda_layers.json"), "w") as f:
        json.dump(meta, f, indent=2)
    make_model()
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(OUT) for f in fs)
    print(f"fixtures: {total / 1e6:.2f} MB")
    assert total < 2e6


if __name__ == "__main__":
    main()
