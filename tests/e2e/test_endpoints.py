"""Models, health, metrics and the tokenizer endpoints."""

import httpx

from conftest import MODEL_NAME, capital_messages


def test_models(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model"
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert http.get("/v1/models/nope").status_code == 404
    # No path on the serving host reaches clients.
    card = http.get("/v1/models").json()["data"][0]
    assert "/" not in card["root"] and card["root"] == MODEL_NAME, card


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200
    # vLLM's liveness, version and load endpoints.
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert http.get("/version").json()["version"]
    assert http.get("/load").json()["server_load"] >= 0


def test_metrics_exposition(server, client):
    client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for name in [
        "wasmserve_http_requests_total",
        "wasmserve_time_to_first_token_seconds",
        "wasmserve_inter_token_latency_seconds",
        "wasmserve_e2e_request_latency_seconds",
        "wasmserve_prompt_tokens_total",
        "wasmserve_generation_tokens_total",
        "wasmserve_kv_cache_usage_ratio",
        "wasmserve_prefix_cache_hit_rate",
        "wasmserve_num_requests_waiting",
        "wasmserve_num_requests_running",
    ]:
        assert f"# TYPE {name} " in text, name
    assert 'wasmserve_time_to_first_token_seconds_bucket{le="+Inf"}' in text
    assert 'wasmserve_http_requests_total{route="/v1/chat/completions",status="200"}' in text
    m = server.metrics()
    assert m["wasmserve_time_to_first_token_seconds_count"] >= 1
    assert m["wasmserve_e2e_request_latency_seconds_count"] >= 1
    assert m["wasmserve_inter_token_latency_seconds_count"] >= 3
    assert m["wasmserve_generation_tokens_total"] >= 4
    assert 0 <= m["wasmserve_kv_cache_usage_ratio"] <= 1
    assert 0 <= m["wasmserve_prefix_cache_hit_rate"] <= 1


def test_prefix_cache_hits_are_reported(server, client):
    long_system = "You are a helpful assistant. " * 20
    messages = [{"role": "system", "content": long_system}, {"role": "user", "content": "Hi"}]
    client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    # Every full 16-token block of the prompt (but the one holding the last token) is reused.
    assert r.usage.prompt_tokens_details.cached_tokens == 16 * ((r.usage.prompt_tokens - 1) // 16)
    assert server.metrics()["wasmserve_prefix_cache_hits_total"] > 0


def test_tokenize_and_detokenize(http):
    r = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == 2
    assert "".join(r["token_strs"]) == "Hello world"
    assert r["max_model_len"] > 0
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": capital_messages()}).json()
    text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    no_gen = http.post("/tokenize", json={"messages": capital_messages(), "add_generation_prompt": False}).json()
    assert no_gen["count"] < chat["count"]
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400
