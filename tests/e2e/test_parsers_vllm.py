"""The Kimi K3 and Qwen3 parser plugins in the real server, against vLLM's own answers.

For every kimi_k3 / qwen3 / qwen3_coder case of tests/reference/parsers/vllm_expected.json (made by
running vLLM 0.33's parsers on the same model text), the real default model is made to write the
case's text with vLLM's `structured_outputs: {"choice": [text]}` (constrained decoding: the model
picks its own tokens, only the text is fixed), and the official openai client reads the
response: non-streamed and streamed, `content`, `reasoning_content` and `tool_calls` (names,
arguments, and for K3 the `functions.NAME:IDX` ids) must equal vLLM's.

The parsers are chosen the way a deployer would: the K3 server only says its model is Kimi-K3
(`--served-model-name`, parsers picked automatically), the Qwen3 servers name them with the
vLLM-style `--reasoning-parser` / `--tool-call-parser` flags.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import ROOT, Server

PLUGINS = ROOT / "target" / "plugins"
CASES = json.loads((ROOT / "tests" / "reference" / "parsers" / "vllm_expected.json").read_text())["cases"]
ADMIN_KEY = "parsers-admin-key"

pytestmark = pytest.mark.skipif(not (PLUGINS / "reasoning-kimi-k3.wasm").exists(), reason="plugins not built (scripts/build-plugins)")

# server name -> (its flags, the model name it serves, which fixture cases it answers)
SERVERS = {
    "k3-auto": (["--served-model-name", "Kimi-K3"], "Kimi-K3", lambda c: c["reasoning_parser"] == "kimi_k3"),
    "qwen3": (["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder"], None,
              lambda c: c["reasoning_parser"] == "qwen3"),
    "qwen3-coder": (["--reasoning-parser", "none", "--tool-call-parser", "qwen3_xml"], None,
                    lambda c: c["reasoning_parser"] is None and c["tool_parser"] == "qwen3_coder"),
}


@pytest.fixture(scope="module", params=list(SERVERS))
def served(request):
    flags, model, select = SERVERS[request.param]
    s = Server(f"parsers-{request.param}", [*flags, "--plugin-dir", str(PLUGINS), "--admin-key", ADMIN_KEY,
                                             "--max-num-seqs", "16"]).start()
    model = model or httpx.get(s.url + "/v1/models").json()["data"][0]["id"]
    yield request.param, s, model, [c for c in CASES if select(c)]
    s.stop()


def request_args(model, case):
    text = case["text"]
    args = {"model": model, "messages": [{"role": "user", "content": "Repeat the text."}], "temperature": 0,
            "max_tokens": len(text.encode()) + 8, "extra_body": {"structured_outputs": {"choice": [text]}}}
    # As in vLLM's chat serving: tool parsing only when the request offers tools.
    if case["tools"] and case["tool_parser"]:
        args["tools"] = case["tools"]
    if case.get("chat_template_kwargs"):
        args["extra_body"]["chat_template_kwargs"] = case["chat_template_kwargs"]
    return args


def whole(client, model, case):
    msg = client.chat.completions.create(**request_args(model, case)).choices[0].message
    calls = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    extra = msg.model_extra or {}
    # Both names (current vLLM clients read `reasoning`, older ones `reasoning_content`).
    assert extra.get("reasoning") == extra.get("reasoning_content"), extra
    return msg.content, extra.get("reasoning_content"), calls


def streamed(client, model, case):
    reasoning, content, calls = "", "", []
    for chunk in client.chat.completions.create(stream=True, **request_args(model, case)):
        for choice in chunk.choices:
            d = choice.delta
            extra = d.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content"), extra
            reasoning += extra.get("reasoning_content") or ""
            content += d.content or ""
            for c in d.tool_calls or []:
                if c.index == len(calls):
                    calls.append([c.id, c.function.name, ""])
                calls[c.index][2] += c.function.arguments or ""
    if case.get("truncated_call"):
        calls.pop()  # vLLM streams the start of a call the text cut off; the whole parse drops it
    # Whitespace-only content beside tool calls is no content (as the non-streamed message).
    content = content if (content.strip() if calls else content) else None
    return content, reasoning or None, [tuple(c) for c in calls]


def check(kind, case, got):
    want = case["expected"]
    content, reasoning, calls = got
    want_calls = [(c["name"], c["arguments"]) for c in want["tool_calls"]]
    problems = []
    if content != want["content"]:
        problems.append(f"content {content!r} != {want['content']!r}")
    if reasoning != want["reasoning"]:
        problems.append(f"reasoning {reasoning!r} != {want['reasoning']!r}")
    if [(n, a) for _, n, a in calls] != want_calls:
        problems.append(f"tool_calls {calls!r} != {want_calls!r}")
    if case["tool_parser"] == "kimi_k3" and [i for i, _, _ in calls] != [c["id"] for c in want["tool_calls"]]:
        problems.append(f"ids {[i for i, _, _ in calls]} != {[c['id'] for c in want['tool_calls']]}")
    return [f"{kind} {case['text']!r}: " + "; ".join(problems)] if problems else []


def test_responses_match_vllm_parsers(served):
    name, srv, model, cases = served
    assert len(cases) >= 8, (name, len(cases))
    client = srv.client(timeout=600)

    def run(case):
        return check("whole", case, whole(client, model, case)) + check("stream", case, streamed(client, model, case))

    with ThreadPoolExecutor(8) as pool:
        failures = [f for fs in pool.map(run, cases) for f in fs]
    assert not failures, f"{len(failures)} of {2 * len(cases)} responses differ from vLLM:\n" + "\n".join(failures)
    # The parsers that answered are the ones the flags (or the model name) chose.
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as a:
        deployed = {d["name"]: d["plugin"]["name"] for d in a.get("/admin/plugins").json()["data"]}
    want = {"k3-auto": {"default-reasoning-parser": "kimi_k3", "default-tool-parser": "kimi_k3"},
            "qwen3": {"default-reasoning-parser": "qwen3", "default-tool-parser": "qwen3"},
            "qwen3-coder": {"default-tool-parser": "qwen3"}}[name]
    assert deployed == want
    srv.wait_idle()
