"""The tiny Kimi-Linear model (KDA + latent attention + MoE, tests/reference/kimi_linear/model),
its routed experts quantized by `wasmserve quantize` to Cubic with mixed widths (expert 0 at
2 bits, expert 1 at 4, the rest at 3; everything else kept dense), served by the real binary as
"Kimi-K3" (so the kimi_k3 reasoning and tool parsers are picked automatically), and read back
through the official openai client: a chat completion whose text is forced with
`structured_outputs.choice` must come back split into `reasoning_content`, `content` and
`tool_calls` exactly as vLLM's kimi_k3 parsers split it (tests/reference/parsers/vllm_expected.json).
"""

import json
import subprocess

import pytest

from conftest import BINARY, ROOT, Server

PLUGINS = ROOT / "target" / "plugins"
KIMI = ROOT / "tests" / "reference" / "kimi_linear" / "model"
CASES = json.loads((ROOT / "tests" / "reference" / "parsers" / "vllm_expected.json").read_text())["cases"]

pytestmark = pytest.mark.skipif(not (PLUGINS / "reasoning-kimi-k3.wasm").exists(), reason="plugins not built (scripts/build-plugins)")

POLICY = {
    "format": "cubic",
    "bits": 3,
    "rules": [
        {"match": "re:.*\\.experts\\.0\\.", "bits": 2},
        {"match": "re:.*\\.experts\\.1\\.", "bits": 4},
        {"match": "re:.*\\.experts\\.[0-9]+\\.", "bits": 3},
        {"match": "re:.*", "skip": True},
    ],
}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kimi")
    policy = tmp / "policy.json"
    policy.write_text(json.dumps(POLICY))
    out = tmp / "kimi-linear-cubic"
    subprocess.run([str(BINARY), "quantize", "--input", str(KIMI), "--output", str(out), "--policy", str(policy), "--quiet"],
                   check=True, timeout=60)
    return out


@pytest.fixture(scope="module")
def served(quantized):
    s = Server("kimi-linear", ["--served-model-name", "Kimi-K3", "--plugin-dir", str(PLUGINS), "--max-num-seqs", "4"])
    s.args[s.args.index("--model") + 1] = str(quantized)
    s.start()
    yield s
    s.stop()


def test_experts_are_cubic_with_mixed_widths(quantized):
    q = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "cubic"
    bits = {m: v["bits"] for m, v in q["modules"].items()}
    assert bits and all(".experts." in m and "shared" not in m for m in bits), bits
    assert bits["model.layers.1.block_sparse_moe.experts.0.w1"] == 2
    assert bits["model.layers.1.block_sparse_moe.experts.1.w2"] == 4
    assert bits["model.layers.3.block_sparse_moe.experts.3.w3"] == 3
    assert sorted(set(bits.values())) == [2, 3, 4]


def test_kimi_k3_parsers_split_a_forced_answer(served):
    case = next(c for c in CASES if c["reasoning_parser"] == "kimi_k3" and c["tool_parser"] == "kimi_k3"
                and c["tools"] and c["expected"]["tool_calls"] and c["expected"]["reasoning"])
    text = case["text"]
    client = served.client()
    resp = client.chat.completions.create(
        model="Kimi-K3", messages=[{"role": "user", "content": "What is the weather in Beijing?"}], temperature=0,
        max_tokens=len(text.encode()) + 8, tools=case["tools"], extra_body={"structured_outputs": {"choice": [text]}})
    msg = resp.choices[0].message
    want = case["expected"]
    assert (msg.model_extra or {}).get("reasoning_content") == want["reasoning"]
    assert (msg.content or None) == (want["content"] or None)
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(c["name"], json.loads(c["arguments"])) for c in want["tool_calls"]]
    assert [c["id"] for c in calls] == [c["id"] for c in want["tool_calls"]]
    assert resp.choices[0].finish_reason == "tool_calls"


def test_unconstrained_generation_runs(served):
    # The quantized hybrid model generates freely too (random weights: any tokens, but all of them).
    resp = served.client().completions.create(model="Kimi-K3", prompt="Hello", max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 12
    served.wait_idle()
