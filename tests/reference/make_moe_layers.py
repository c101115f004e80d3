"""MoE block reference fixtures for tests/reference_moe.rs.

Each case is a directory tests/reference/moe/<case>/ holding a one-block checkpoint
(config.json in the original checkpoint's key spelling + model.safetensors, tensors under the
original per-expert Hugging Face names of layer 1) and io/reference.safetensors with the input
rows, the reference output and the reference routing (expert ids sorted per token, as f32, with
their weights).

  deepseek_v3  transformers DeepseekV3MoE: sigmoid, noaux_tc (e_score_correction_bias), 4 groups
               keep 2, top-4 of 16, renormalised, x2.5, 2 shared experts
  deepseek_v2  transformers DeepseekV2Moe: softmax, group_limited_greedy (4 groups keep 2), top-4,
               not renormalised, x1.5, 1 shared expert
  kimi_linear  transformers KimiLinearMoE (`block_sparse_moe`, experts w1/w3/w2): sigmoid,
               noaux_tc, 2 groups keep 1, top-4, renormalised, x1.7, 1 shared expert
  kimi_latent  Kimi K3 latent MoE. transformers has no latent MoE, so the reference is written
               here from the formula in docs/formats.md §5.4-5.5 (routing still by
               transformers' KimiLinearTopkRouter): r = down(x); y = Σ w_k expert_k(r) in the
               latent width with SiTU experts; y = RMSNorm(y)·norm_w; out = up(y) + shared(x)

Router weights and biases are scaled so that grouping and the bias both change the choice for
some tokens (checked below), and every token's choice has a clear margin (no near-ties that f32
summation order could flip).

Run: .venv/bin/python tests/reference/make_moe_layers.py
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV3Config, KimiLinearConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE, KimiLinearTopkRouter

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "moe")
HIDDEN, EXPERTS, TOP_K, INTER, TOKENS = 64, 16, 4, 32, 13
LAYER = 1


def randomize(module, router_std, bias_std):
    """Non-trivial weights: transformers initialises routers to zero and std 0.02 elsewhere."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "gate.weight":
                p.normal_(0.0, router_std)
            else:
                p.normal_(0.0, 0.1)
        if hasattr(module.gate, "e_score_correction_bias"):
            module.gate.e_score_correction_bias.normal_(0.0, bias_std)


def expert_tensors(module, prefix, leaves):
    """transformers keeps experts fused ([E, 2I, H] gate|up and [E, H, I]); checkpoints keep one
    tensor per expert and projection."""
    gate_up = module.experts.gate_up_proj.detach()
    down = module.experts.down_proj.detach()
    out = {}
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2, dim=0)
        out[f"{prefix}.experts.{e}.{leaves[0]}.weight"] = gate.contiguous()
        out[f"{prefix}.experts.{e}.{leaves[1]}.weight"] = up.contiguous()
        out[f"{prefix}.experts.{e}.{leaves[2]}.weight"] = down[e].contiguous()
    return out


def block_tensors(module, prefix, leaves):
    t = expert_tensors(module, prefix, leaves)
    t[f"{prefix}.gate.weight"] = module.gate.weight.detach().contiguous()
    if hasattr(module.gate, "e_score_correction_bias"):
        t[f"{prefix}.gate.e_score_correction_bias"] = module.gate.e_score_correction_bias.detach().contiguous()
    for leaf in ["gate_proj", "up_proj", "down_proj"]:
        t[f"{prefix}.shared_experts.{leaf}.weight"] = getattr(module.shared_experts, leaf).weight.detach().contiguous()
    return t


def check_routing(ids, scores_for_choice, alt_ids, what):
    """Margins and that the feature under test matters."""
    kth = scores_for_choice.gather(1, ids).min(dim=1).values
    masked = scores_for_choice.scatter(1, ids, float("-inf"))
    next_best = masked.max(dim=1).values
    finite = torch.isfinite(next_best)
    margin = (kth - next_best)[finite].min().item() if finite.any() else float("inf")
    assert margin > 1e-4, f"{what}: near-tie in expert choice (margin {margin})"
    differ = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, alt_ids))
    assert differ > 0, f"{what}: the feature does not change any token's routing"
    return margin, differ


def grouped_choice(scores, bias, n_group, topk_group, top_k, sum_top2):
    """Choice scores after the group mask (for margin checks and counter-factuals)."""
    s = scores + bias if bias is not None else scores.clone()
    g = s.view(s.shape[0], n_group, -1)
    gs = g.topk(2, dim=-1)[0].sum(-1) if sum_top2 else g.max(-1).values
    keep = torch.topk(gs, k=topk_group, dim=-1)[1]
    mask = torch.zeros_like(gs).scatter_(1, keep, 1).bool()
    mask = mask.unsqueeze(-1).expand_as(g).reshape(s.shape)
    return s.masked_fill(~mask, float("-inf"))


def save_case(name, config, tensors, x, y, ids, weights, notes):
    d = os.path.join(OUT, name)
    os.makedirs(os.path.join(d, "io"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(d, "model.safetensors"))
    order = ids.sort(dim=1)
    save_file(
        {
            "input": x.contiguous(),
            "output": y.contiguous(),
            "routing.experts": order.values.float().contiguous(),
            "routing.weights": weights.gather(1, order.indices).contiguous(),
        },
        os.path.join(d, "io", "reference.safetensors"),
    )
    notes[name] = {"prefix": f"model.layers.{LAYER}", **notes.get(name, {})}


def deepseek_v3(notes):
    torch.manual_seed(3)
    raw = dict(model_type="deepseek_v3", hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=INTER,
               n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=4, topk_group=2, topk_method="noaux_tc",
               scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=2,
               first_k_dense_replace=1, moe_layer_freq=1, hidden_act="silu", rms_norm_eps=1e-6, num_hidden_layers=2)
    cfg = DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("model_type", "topk_method", "scoring_func")})
    m = DeepseekV3MoE(cfg).eval()
    randomize(m, 0.15, 0.3)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        y = m(x.unsqueeze(0)).squeeze(0)
        _, w, ids = m.gate(x)
        scores = torch.sigmoid(x @ m.gate.weight.T)
        bias = m.gate.e_score_correction_bias
        choice = grouped_choice(scores, bias, 4, 2, TOP_K, True)
        no_group = torch.topk(scores + bias, TOP_K)[1]
        no_bias = torch.topk(grouped_choice(scores, None, 4, 2, TOP_K, True), TOP_K)[1]
    margin, by_group = check_routing(ids, choice, no_group, "deepseek_v3 groups")
    _, by_bias = check_routing(ids, choice, no_bias, "deepseek_v3 bias")
    notes["deepseek_v3"] = {"module": "mlp", "margin": margin, "tokens_changed_by_groups": by_group, "tokens_changed_by_bias": by_bias}
    save_case("deepseek_v3", raw, block_tensors(m, f"model.layers.{LAYER}.mlp", ["gate_proj", "up_proj", "down_proj"]), x, y, ids, w, notes)


def deepseek_v2(notes):
    torch.manual_seed(2)
    raw = dict(model_type="deepseek_v2", hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=INTER,
               n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=4, topk_group=2, topk_method="group_limited_greedy",
               scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.5, n_shared_experts=1,
               first_k_dense_replace=1, moe_layer_freq=1, hidden_act="silu", rms_norm_eps=1e-6, num_hidden_layers=2)
    cfg = DeepseekV2Config(**{k: v for k, v in raw.items() if k not in ("model_type", "scoring_func")})
    m = DeepseekV2Moe(cfg).eval()
    randomize(m, 0.2, 0.0)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        y = m(x.unsqueeze(0)).squeeze(0)
        _, w, ids = m.gate(x)
        scores = torch.softmax(x @ m.gate.weight.T, dim=-1)
        choice = grouped_choice(scores, None, 4, 2, TOP_K, False)
        no_group = torch.topk(scores, TOP_K)[1]
    margin, by_group = check_routing(ids, choice, no_group, "deepseek_v2 groups")
    notes["deepseek_v2"] = {"module": "mlp", "margin": margin, "tokens_changed_by_groups": by_group}
    save_case("deepseek_v2", raw, block_tensors(m, f"model.layers.{LAYER}.mlp", ["gate_proj", "up_proj", "down_proj"]), x, y, ids, w, notes)


def kimi_raw(**extra):
    raw = dict(model_type="kimi_linear", hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=INTER,
               num_experts=EXPERTS, num_experts_per_token=TOP_K, num_expert_group=2, topk_group=1, use_grouped_topk=True,
               moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=1.7, num_shared_experts=1,
               first_k_dense_replace=1, moe_layer_freq=1, hidden_act="silu", rms_norm_eps=1e-5, num_hidden_layers=2)
    raw.update(extra)
    return raw


def kimi_config(raw):
    keep = ["hidden_size", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_token", "num_expert_group",
            "topk_group", "moe_renormalize", "routed_scaling_factor", "num_shared_experts", "rms_norm_eps", "num_hidden_layers"]
    return KimiLinearConfig(**{k: raw[k] for k in keep}, hidden_act="silu", first_k_dense_replace=1)


def kimi_linear(notes):
    torch.manual_seed(5)
    raw = kimi_raw()
    m = KimiLinearMoE(kimi_config(raw)).eval()
    randomize(m, 0.15, 0.3)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        y = m(x.unsqueeze(0)).squeeze(0)
        _, w, ids = m.gate(x)
        scores = torch.sigmoid(x @ m.gate.weight.T)
        bias = m.gate.e_score_correction_bias
        choice = grouped_choice(scores, bias, 2, 1, TOP_K, True)
        no_group = torch.topk(scores + bias, TOP_K)[1]
    margin, by_group = check_routing(ids, choice, no_group, "kimi_linear groups")
    notes["kimi_linear"] = {"module": "block_sparse_moe", "margin": margin, "tokens_changed_by_groups": by_group}
    save_case("kimi_linear", raw, block_tensors(m, f"model.layers.{LAYER}.block_sparse_moe", ["w1", "w3", "w2"]), x, y, ids, w, notes)


def situ(gate, up, beta=4.0, linear_beta=25.0):
    # docs/formats.md §5.5: sigmoid of the unclipped gate; both halves tanh-clipped.
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def mlp(x, g, u, d):
    return situ(x @ g.T, x @ u.T) @ d.T


def kimi_latent(notes):
    torch.manual_seed(7)
    latent = 32
    raw = kimi_raw(routed_expert_hidden_size=latent, latent_moe_use_norm=True, hidden_act="situ", activation_situ_beta=4.0,
                   activation_situ_linear_beta=25.0, num_shared_experts=2, routed_scaling_factor=1.5, topk_method="noaux_tc")
    router = KimiLinearTopkRouter(kimi_config(raw)).eval()
    p = f"model.layers.{LAYER}.block_sparse_moe"
    with torch.no_grad():
        router.weight.normal_(0.0, 0.15)
        router.e_score_correction_bias.normal_(0.0, 0.3)
    t = {f"{p}.gate.weight": router.weight.detach().clone(), f"{p}.gate.e_score_correction_bias": router.e_score_correction_bias.detach().clone()}
    rn = lambda *s: torch.randn(*s) * 0.1
    t[f"{p}.routed_expert_down_proj.weight"] = rn(latent, HIDDEN)
    t[f"{p}.routed_expert_up_proj.weight"] = rn(HIDDEN, latent)
    t[f"{p}.routed_expert_norm.weight"] = 1.0 + rn(latent)
    for e in range(EXPERTS):
        for leaf, shape in [("w1", (INTER, latent)), ("w3", (INTER, latent)), ("w2", (latent, INTER))]:
            t[f"{p}.experts.{e}.{leaf}.weight"] = rn(*shape) * 3
    shared = 2 * INTER
    for leaf, shape in [("gate_proj", (shared, HIDDEN)), ("up_proj", (shared, HIDDEN)), ("down_proj", (HIDDEN, shared))]:
        t[f"{p}.shared_experts.{leaf}.weight"] = rn(*shape) * 3
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        _, w, ids = router(x)
        r = x @ t[f"{p}.routed_expert_down_proj.weight"].T
        ysum = torch.zeros(TOKENS, latent)
        for tok in range(TOKENS):
            for k in range(TOP_K):
                e = ids[tok, k].item()
                ysum[tok] += w[tok, k] * mlp(r[tok], *(t[f"{p}.experts.{e}.{leaf}.weight"] for leaf in ["w1", "w3", "w2"]))
        normed = ysum * torch.rsqrt(ysum.pow(2).mean(-1, keepdim=True) + raw["rms_norm_eps"]) * t[f"{p}.routed_expert_norm.weight"]
        y = normed @ t[f"{p}.routed_expert_up_proj.weight"].T + mlp(x, *(t[f"{p}.shared_experts.{leaf}.weight"] for leaf in ["gate_proj", "up_proj", "down_proj"]))
        scores = torch.sigmoid(x @ router.weight.T)
        choice = grouped_choice(scores, router.e_score_correction_bias, 2, 1, TOP_K, True)
        no_bias = torch.topk(grouped_choice(scores, None, 2, 1, TOP_K, True), TOP_K)[1]
    margin, by_bias = check_routing(ids, choice, no_bias, "kimi_latent bias")
    notes["kimi_latent"] = {"module": "block_sparse_moe", "margin": margin, "tokens_changed_by_bias": by_bias,
                            "reference": "own torch code from docs/formats.md 5.4/5.5 (no transformers latent MoE); routing by transformers KimiLinearTopkRouter"}
    save_case("kimi_latent", raw, {k: v.contiguous() for k, v in t.items()}, x, y, ids, w, notes)


def main():
    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    notes = {}
    for case in [deepseek_v3, deepseek_v2, kimi_linear, kimi_latent]:
        case(notes)
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(notes, f, indent=2, sort_keys=True)
    print(json.dumps(notes, indent=2))


if __name__ == "__main__":
    main()
