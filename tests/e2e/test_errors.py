"""Every error status, in OpenAI's shape: 400, 401, 404, 405, 413, 429, 503."""

import json
import signal
import time

import httpx
import openai
import pytest

from conftest import MODEL_NAME, Server, capital_messages


def assert_openai_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def chat_body(**kw):
    return {"model": MODEL_NAME, "messages": capital_messages(), "max_tokens": 4, **kw}


# ---- 400 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[1, 2]", b'{"messages": [}', b'{"model": "x"} trailing'],
)
def test_invalid_json_is_400(http, raw):
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"top_k": -7}, "top_k"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"stop": 5}, "stop"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a+"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"json": {"type": "object", "required": ["a"]}}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ],
)
def test_invalid_fields_are_400(http, fields, param):
    assert_openai_error(http.post("/v1/chat/completions", json=chat_body(**fields)), 400, param=param)


def test_engine_validation_is_400(http):
    assert_openai_error(http.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=50)), 400, param="top_logprobs")
    # A text completion asks for the same width as `logprobs`, and its error says so.
    err = assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": 21}), 400, param="logprobs")
    assert "'logprobs' must be at most 20" in err["message"], err
    err = assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": 21, "echo": True}), 400, param="logprobs")
    assert_openai_error(http.post("/v1/chat/completions", json=chat_body(n=1000)), 400)
    assert_openai_error(http.post("/v1/completions", json={"prompt": [10**8], "max_tokens": 2}), 400)
    assert_openai_error(http.post("/v1/completions", json={"prompt": "", "max_tokens": 2}), 400)
    assert_openai_error(http.post("/v1/completions", json={"prompt": {"a": 1}}), 400, param="prompt")
    assert_openai_error(http.post("/v1/completions", json={"max_tokens": 2}), 400)
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400, param="suffix")


def test_per_token_work_is_capped(http):
    # Every entry of these lists is checked on every generated token: one request may not make
    # the whole batch slow.
    assert_openai_error(http.post("/v1/chat/completions", json=chat_body(stop=[f"s{i}" for i in range(17)])), 400, param="stop")
    assert_openai_error(http.post("/v1/chat/completions", json=chat_body(stop=["x" * 300])), 400, param="stop")
    assert_openai_error(http.post("/v1/chat/completions", json=chat_body(logit_bias={str(i): 1 for i in range(1025)})), 400, param="logit_bias")
    assert_openai_error(http.post("/v1/chat/completions", json=chat_body(structured_outputs={"choice": [f"c{i}" for i in range(300)]})), 400, param="structured_outputs")
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert_openai_error(http.post("/v1/chat/completions", json=chat_body(tools=tools)), 400, param="tools")
    assert_openai_error(http.post("/v1/completions", json={"prompt": ["a"] * 65, "max_tokens": 1}), 400, param="prompt")
    assert_openai_error(http.post("/v1/completions", json={"prompt": ["a"] * 20, "n": 16, "max_tokens": 1}), 400, param="prompt")
    assert http.post("/v1/chat/completions", json=chat_body(stop=[f"s{i}" for i in range(16)])).status_code == 200


def test_non_ascii_stop_strings(http):
    # A stop string whose byte prefix ends inside a character once killed the engine thread.
    for stop in [["é"], ["。", "→"], ["aé", "日本"]]:
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "stop": stop, "temperature": 0})
        assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json=chat_body(stop=["é"]))
    assert r.status_code == 200, r.text
    assert http.get("/health").status_code == 200


def test_context_length_exceeded(client, http):
    max_len = http.post("/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    long_prompt = "hello " * (max_len + 10)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    assert e.value.body["param"] == "messages"
    r = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2})
    assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")


def test_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=-3)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "temperature"


# ---- 404 / 405 -------------------------------------------------------------------------------


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=capital_messages())
    assert e.value.code == "model_not_found"
    assert_openai_error(http.post("/v1/completions", json={"model": "nope", "prompt": "hi"}), 404, param="model", code="model_not_found")
    assert_openai_error(http.get("/v1/models/gpt-17"), 404, code="model_not_found")


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/chat/completions"), 405)


# ---- a server with a key, a tiny queue and a small body limit --------------------------------


@pytest.fixture(scope="module")
def strict():
    s = Server("strict", ["--api-key", "sekrit", "--max-num-seqs", "1", "--max-queue", "1", "--max-body-bytes", "4096"]).start()
    yield s
    s.stop()


def test_api_key_is_required(strict):
    with pytest.raises(openai.AuthenticationError) as e:
        strict.client(api_key="wrong").chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=2)
    assert e.value.status_code == 401
    assert_openai_error(httpx.post(strict.url + "/v1/chat/completions", json=chat_body()), 401, code="invalid_api_key")
    assert_openai_error(httpx.get(strict.url + "/v1/models"), 401)
    assert_openai_error(httpx.post(strict.url + "/tokenize", json={"prompt": "x"}), 401)
    assert_openai_error(httpx.get(strict.url + "/v1/models", headers={"authorization": "Basic sekrit"}), 401)
    r = strict.client(api_key="sekrit").chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=2)
    assert r.usage.completion_tokens == 2
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(strict.url + "/health").status_code == 200
    assert httpx.get(strict.url + "/metrics").status_code == 200


def test_api_key_from_environment():
    s = Server("envkey", env={"WASMSERVE_API_KEY": "from-env"}).start()
    try:
        assert_openai_error(httpx.get(s.url + "/v1/models"), 401)
        assert httpx.get(s.url + "/v1/models", headers={"authorization": "Bearer from-env"}).status_code == 200
    finally:
        s.stop()


def test_body_too_large_is_413(strict):
    auth = {"authorization": "Bearer sekrit"}
    big = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * 5000}])).encode()
    assert_openai_error(httpx.post(strict.url + "/v1/chat/completions", content=big, headers=auth), 413)

    def chunked():  # no Content-Length: the limit must hold while reading
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    assert_openai_error(httpx.post(strict.url + "/v1/chat/completions", content=chunked(), headers=auth), 413)
    with pytest.raises(openai.APIStatusError) as e:
        strict.client(api_key="sekrit").chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "y" * 5000}])
    assert e.value.status_code == 413
    small = json.dumps(chat_body()).encode()
    assert httpx.post(strict.url + "/v1/chat/completions", content=small, headers=auth).status_code == 200


def wait_for(pred, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def test_full_queue_is_429(strict):
    """One running sequence (max-num-seqs 1), one waiting (max-queue 1): the next is refused."""
    auth = {"authorization": "Bearer sekrit"}
    long = chat_body(max_tokens=2000, stream=True, ignore_eos=True)
    with httpx.Client(base_url=strict.url, headers=auth, timeout=60) as a_client, httpx.Client(base_url=strict.url, headers=auth, timeout=60) as b_client:
        with a_client.stream("POST", "/v1/chat/completions", json=long) as a:
            assert a.status_code == 200
            # Keep the iterator alive: a collected httpx line iterator closes the connection.
            a_lines = a.iter_lines()
            next(line for line in a_lines if '"content":"' in line and '"content":""' not in line)
            # The queue count is published at the end of the engine step that admitted `a` (it
            # errs on the safe side); on a loaded machine its first token can arrive before that.
            wait_for(lambda: strict.metrics()["wasmserve_num_requests_waiting"] == 0)
            with b_client.stream("POST", "/v1/chat/completions", json=long) as b:
                assert b.status_code == 200
                wait_for(lambda: strict.metrics()["wasmserve_num_requests_waiting"] == 1)
                with pytest.raises(openai.RateLimitError) as e:
                    strict.client(api_key="sekrit").chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=2)
                assert e.value.status_code == 429
                assert_openai_error(httpx.post(strict.url + "/v1/completions", json={"prompt": "hi"}, headers=auth), 429, code="rate_limit_exceeded")
    # Both streams were dropped by the client: the engine frees everything.
    strict.wait_idle()
    r = strict.client(api_key="sekrit").chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=2)
    assert r.usage.completion_tokens == 2


# ---- 503 and graceful shutdown ---------------------------------------------------------------


def test_shutdown_drains_streams_and_refuses_new_work():
    s = Server("shutdown").start()
    try:
        body = chat_body(max_tokens=100, stream=True, ignore_eos=True, stream_options={"include_usage": True})
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if '"content":"' in line and '"content":""' not in line)
                s.proc.send_signal(signal.SIGTERM)
                wait_for(lambda: httpx.get(s.url + "/health").status_code == 503)
                assert_openai_error(httpx.post(s.url + "/v1/chat/completions", json=chat_body()), 503, code="shutting_down")
                with pytest.raises(openai.APIStatusError) as e:
                    s.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
                assert e.value.status_code == 503
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] == 100
        assert '"finish_reason":"length"' in rest[-3]
        assert s.proc.wait(timeout=30) == 0
        assert "draining" in s.log_text()
    finally:
        s.stop()


def test_a_negative_max_tokens_names_the_field_in_api_terms(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "non-negative integer" in err["message"] and "u64" not in err["message"], err


def test_legacy_function_calling_is_refused_by_name(http):
    for field, value, instead in [("functions", [{"name": "f", "parameters": {"type": "object"}}], "tools"),
                                  ("function_call", "auto", "tool_choice")]:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and instead in err["message"], err
