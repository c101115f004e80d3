"""Wasm plugins in the real server with the real built components (target/plugins/, from
scripts/build-plugins): parsers deployed from a config file and through the admin API, a
plugin failure failing only its own request (clear 5xx naming the plugin) while the next
request succeeds, a failing upload changing nothing, a parser hot-swapped while 32 streams
run without any stream failing, and a chat-template plugin that fails: a server error naming it,
while the template's own refusal stays the client's 400.
"""

import asyncio
import json
import os

import httpx
import openai
import pytest

from conftest import LOG_DIR, MODEL_NAME, ROOT, Server, capital_messages

PLUGINS = ROOT / "target" / "plugins"
ADMIN_KEY = "plugin-admin-" + os.urandom(8).hex()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

pytestmark = pytest.mark.skipif(not (PLUGINS / "reasoning-deepseek-r1.wasm").exists() and os.environ.get("WASMSERVE_REQUIRE_PLUGINS") != "1",
                                reason="plugins not built (scripts/build-plugins)")


@pytest.fixture(scope="module")
def psrv():
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    cfg = LOG_DIR / "plugins.json"
    cfg.write_text(json.dumps({"plugins": [
        {"name": "reasoning", "kind": "reasoning-parser", "component": str(PLUGINS / "reasoning-deepseek-r1.wasm")},
        {"name": "tools", "kind": "tool-parser", "component": str(PLUGINS / "tool-hermes.wasm")},
    ]}))
    s = Server("plugins", ["--plugins", str(cfg), "--admin-key", ADMIN_KEY]).start()
    yield s
    s.stop()


def admin(psrv):
    return httpx.Client(base_url=psrv.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120)


def upload(psrv, name, kind, component, config=None, limits=None):
    spec = {"name": name, "kind": kind, "config": config or {}}
    if limits:
        spec["limits"] = limits
    with admin(psrv) as a:
        return a.post("/admin/plugins", content=(PLUGINS / f"{component}.wasm").read_bytes(), headers={"x-plugin-spec": json.dumps(spec)})


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=12, temperature=0, **kw)


def test_reasoning_parser_splits_output_whole_and_streamed(psrv):
    c = psrv.client()
    # SmolLM2 writes no <think> markers: deepseek_r1 (as vLLM's) calls all of it reasoning.
    r = chat(c)
    msg = r.choices[0].message
    assert msg.content is None
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and "Paris" in reasoning
    parts, content = [], []
    for ch in chat(c, stream=True):
        for choice in ch.choices:
            d = choice.delta.model_extra or {}
            parts.append(d.get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    assert "".join(parts) == reasoning
    assert "".join(content) == ""


def test_tools_parser_passes_plain_content(psrv):
    c = psrv.client()
    with admin(psrv) as a:
        assert a.delete("/admin/plugins/reasoning").status_code == 200
    try:
        r = chat(c, tools=TOOLS)
        assert r.choices[0].message.content and "Paris" in r.choices[0].message.content
        assert not r.choices[0].message.tool_calls
    finally:
        assert upload(psrv, "reasoning", "reasoning-parser", "reasoning-deepseek-r1").status_code == 201


def test_admin_api_needs_the_key_and_lists_deployments(psrv):
    assert httpx.get(psrv.url + "/admin/plugins").status_code == 403
    with admin(psrv) as a:
        data = a.get("/admin/plugins").json()["data"]
    names = {d["name"]: d for d in data}
    assert names["reasoning"]["plugin"]["name"] == "deepseek_r1"
    assert names["tools"]["plugin"]["name"] == "hermes"
    assert names["reasoning"]["metrics"]["calls"] >= 0
    m = psrv.metrics()
    assert 'wasmserve_plugin_calls_total{plugin="reasoning",kind="reasoning-parser"}' in m


def test_failing_upload_changes_nothing(psrv):
    with admin(psrv) as a:
        before = a.get("/admin/plugins/reasoning").json()
        # Not a component; then a component of the wrong world; then a config the plugin refuses.
        bad = a.post("/admin/plugins", content=b"\0asm junk", headers={"x-plugin-spec": json.dumps({"name": "reasoning", "kind": "reasoning-parser"})})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_plugin"
    assert upload(psrv, "reasoning", "reasoning-parser", "tool-hermes").status_code == 400
    r = upload(psrv, "limit", "request-policy", "policy-prompt-length-limit")
    assert r.status_code == 400 and "max_prompt_tokens" in r.json()["error"]["message"]
    with admin(psrv) as a:
        after = a.get("/admin/plugins/reasoning").json()
        assert a.get("/admin/plugins/limit").status_code == 404
    assert (after["version"], after["sha"]) == (before["version"], before["sha"])
    assert chat(psrv.client()).choices[0].message.model_extra["reasoning_content"]


@pytest.mark.parametrize("trigger,code,status", [("TRAP", "plugin_trap", 500), ("LOOP", "plugin_timeout", 504),
                                                 ("BOMB", "plugin_out_of_memory", 500), ("BADUTF8", "plugin_invalid_output", 502)])
def test_hostile_plugin_fails_only_its_request(psrv, trigger, code, status):
    c = psrv.client()
    # The allocation bomb gets time to reach the memory limit (not the deadline) on a busy machine.
    limits = {"memory_bytes": 32 << 20, "call_timeout_ms": 2000 if trigger == "BOMB" else 50}
    assert upload(psrv, "tools", "tool-parser", "hostile-tool", {"always": trigger}, limits).status_code == 201
    try:
        with pytest.raises(openai.APIStatusError) as e:
            chat(c, tools=TOOLS)
        assert e.value.status_code == status
        err = e.value.body["error"] if "error" in e.value.body else e.value.body
        assert err["code"] == code and "'tools'" in err["message"], err
        # Streaming: the error arrives as an event and the stream ends.
        with httpx.stream("POST", psrv.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL_NAME, "messages": capital_messages(), "max_tokens": 8, "stream": True, "tools": TOOLS}) as r:
            body = r.read().decode()
        assert code in body and body.rstrip().endswith("data: [DONE]")
        # A request the plugin does not serve (no tools) succeeds meanwhile.
        assert chat(c).choices[0].message.model_extra["reasoning_content"]
    finally:
        assert upload(psrv, "tools", "tool-parser", "tool-hermes").status_code == 201
    # And with the parser restored, tools requests work again.
    assert chat(c, tools=TOOLS).choices[0].finish_reason in ("stop", "length")
    psrv.wait_idle()


def test_hot_swap_under_32_streams(psrv):
    async def one(client):
        text = ""
        stream = await client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=24, temperature=0, stream=True)
        async for ch in stream:
            for choice in ch.choices:
                d = choice.delta.model_extra or {}
                text += (d.get("reasoning_content") or "") + (choice.delta.content or "")
        return text

    async def swaps(n):
        async with httpx.AsyncClient(base_url=psrv.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120) as a:
            versions = []
            for i in range(n):
                comp = "reasoning-qwen3" if i % 2 == 0 else "reasoning-deepseek-r1"
                r = await a.post("/admin/plugins", content=(PLUGINS / f"{comp}.wasm").read_bytes(),
                                 headers={"x-plugin-spec": json.dumps({"name": "reasoning", "kind": "reasoning-parser"})})
                assert r.status_code == 201, r.text
                versions.append(r.json()["version"])
                await asyncio.sleep(0.05)
            return versions

    async def main():
        client = openai.AsyncOpenAI(base_url=psrv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        results = await asyncio.gather(*[one(client) for _ in range(32)], swaps(4))
        await client.close()
        return results

    *texts, versions = asyncio.run(main())
    assert versions == sorted(versions) and len(set(versions)) == 4
    assert all("Paris" in t for t in texts), texts
    psrv.wait_idle()


def test_request_policies_cap_reject_and_contain_bad_output(psrv):
    c = psrv.client()
    with admin(psrv) as a:
        try:
            assert upload(psrv, "p1-cap", "request-policy", "policy-max-tokens-cap", {"max_tokens": 3}).status_code == 201
            r = chat(c)
            assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
            chunks = list(chat(c, stream=True, stream_options={"include_usage": True}))
            assert chunks[-1].usage.completion_tokens == 3
            assert upload(psrv, "p2-len", "request-policy", "policy-prompt-length-limit", {"max_prompt_tokens": 5}).status_code == 201
            with pytest.raises(openai.BadRequestError) as e:
                chat(c)
            assert e.value.body["code"] == "policy_rejected" and "p2-len" in e.value.body["message"]
            assert a.delete("/admin/plugins/p2-len").status_code == 200
            # A policy returning malformed JSON fails only the request that triggered it.
            assert upload(psrv, "p3-hostile", "request-policy", "hostile-policy").status_code == 201
            with pytest.raises(openai.APIStatusError) as e:
                chat(c, stop=["BADJSON"])
            assert e.value.status_code == 502 and e.value.body["code"] == "plugin_invalid_output"
            assert chat(c).usage.completion_tokens == 3
            # A rewrite that makes the request invalid is the policy's error (500), not the client's.
            with pytest.raises(openai.InternalServerError) as e:
                chat(c, stop=["BADPARAM"])
            assert e.value.body["code"] == "policy_error" and "top_p" in e.value.body["message"]
            m = a.get("/admin/plugins/p3-hostile").json()["metrics"]
            assert m["invalid_output"] == 1 and m["instances_discarded"] == 1
        finally:
            for n in ("p1-cap", "p2-len", "p3-hostile"):
                a.delete(f"/admin/plugins/{n}")
    assert chat(c).usage.completion_tokens > 3


# A ChatML template (SmolLM2's format) that loops for ever on a message "LOOP" and raises on "RAISE".
LOOPING_TEMPLATE = (
    "{% if messages[-1]['content'] == 'LOOP' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[-1]['content'] == 'RAISE' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_failing_chat_template_plugin_is_a_server_error():
    cfg = LOG_DIR / "template-plugin.json"
    cfg.write_text(json.dumps({"plugins": [{"name": "template", "kind": "chat-template", "component": str(PLUGINS / "chat-template-jinja.wasm"),
                                            "config": {"template": LOOPING_TEMPLATE}, "limits": {"call_timeout_ms": 200}}]}))
    srv = Server("template-plugin", ["--plugins", str(cfg)]).start()
    try:
        c = srv.client()
        say = lambda text, **kw: c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0, **kw)
        assert "chat template rendered by a Wasm plugin" in srv.log_text()
        with pytest.raises(openai.APIStatusError) as e:
            say("LOOP")
        assert e.value.status_code == 504
        assert e.value.body["code"] == "plugin_timeout" and "'template'" in e.value.body["message"], e.value.body
        # Streaming renders before the stream starts: the same status, not an event.
        with pytest.raises(openai.APIStatusError) as e:
            say("LOOP", stream=True)
        assert e.value.status_code == 504
        r = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "LOOP"}]}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "plugin_timeout", r.text
        # The template's own refusal is the request's fault.
        with pytest.raises(openai.BadRequestError) as e:
            say("RAISE")
        assert "roles must alternate" in e.value.message
        # Other requests render through the plugin and are answered.
        r = say("Hi")
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
        ids = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
        assert r.usage.prompt_tokens == len(ids)
        assert httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    finally:
        srv.stop()
