"""Chat completions through the official openai client (and raw HTTP where the client hides details)."""

import json

import httpx
import openai
import pytest

from conftest import MODEL_NAME, capital_messages

PARIS = "The capital of France is Paris."


def tokenize(http, **body):
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_answer_and_usage_match_the_tokenizer(client, http):
    r = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0)
    assert r.object == "chat.completion"
    assert r.model == MODEL_NAME
    assert r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert c.message.content == PARIS
    assert c.finish_reason == "stop"
    prompt = tokenize(http, messages=capital_messages())
    assert r.usage.prompt_tokens == prompt["count"]
    # The answer's tokens plus the end-of-turn token that stopped it.
    answer = tokenize(http, prompt=PARIS, add_special_tokens=False)
    assert r.usage.completion_tokens == answer["count"] + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_matches_non_stream_and_reports_usage(client, http):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=capital_messages(), temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == PARIS
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    # include_usage: a final chunk with no choices carries the usage; the others have null.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == tokenize(http, messages=capital_messages())["count"]
    assert chunks[-1].usage.completion_tokens == tokenize(http, prompt=PARIS, add_special_tokens=False)["count"] + 1


def test_raw_sse_framing(http):
    body = {"model": MODEL_NAME, "messages": capital_messages(), "temperature": 0, "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), raw
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in payloads)  # no include_usage: no usage field at all


def test_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Write a short poem about the sea."}], n=2, max_tokens=24, temperature=1.0, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 48  # two choices, each cut at max_tokens
    assert all(c.finish_reason == "length" for c in r.choices)


def test_n_choices_stream(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=capital_messages(), n=2, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    texts, finish = {0: "", 1: ""}, {}
    usage = None
    for c in stream:
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == {0: PARIS, 1: PARIS}  # greedy: both choices agree
    assert finish == {0: "stop", 1: "stop"}
    assert usage.completion_tokens == 2 * 8


def test_stop_strings(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0, stop=["Paris", "Lyon"])
    assert r.choices[0].message.content == "The capital of France is "
    assert r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0, stop="France", stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "The capital of "


def test_seed_reproducibility(client):
    def sample(seed):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0, max_tokens=24, seed=seed
        )
        return r.choices[0].message.content

    a = sample(1234)
    assert sample(1234) == a
    assert any(sample(s) != a for s in (1, 2, 3))


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = ""
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(lps[0])
        assert bytes(entry.bytes).decode() == entry.token
        text += entry.token
    assert text == PARIS + "<|im_end|>"
    # Without top_logprobs only the chosen token is reported.
    r = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0, logprobs=True, max_tokens=3)
    assert [e.top_logprobs for e in r.choices[0].logprobs.content] == [[], [], []]
    r = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0, max_tokens=3)
    assert r.choices[0].logprobs is None


def test_logprobs_stream(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=capital_messages(), temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(e.token for e in entries) == PARIS + "<|im_end|>"
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_max_tokens_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.content == "The capital of"
    r = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0, max_completion_tokens=2)
    assert r.usage.completion_tokens == 2


def test_sampling_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=capital_messages(),
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        max_tokens=8,
        seed=3,
        user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.choices[0].message.content


def test_logit_bias(client, http):
    paris = tokenize(http, prompt=" Paris", add_special_tokens=False)["tokens"]
    assert len(paris) == 1
    r = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0, logit_bias={str(paris[0]): -100})
    assert "Paris" not in r.choices[0].message.content.split(".")[0]
    forced = tokenize(http, prompt=" banana", add_special_tokens=False, return_token_strs=True)
    assert forced["count"] == 1
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=capital_messages(), max_tokens=3, logprobs=True, logit_bias={str(forced["tokens"][0]): 100}
    )
    assert [e.token for e in r.choices[0].logprobs.content] == forced["token_strs"] * 3
    assert r.choices[0].message.content == " banana" * 3


def test_roles_content_parts_and_assistant_round_trip(client, http):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy: it is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=12)
    assert r.choices[0].message.content
    # The template sees the joined text parts: same tokens as a plain string message.
    joined = [dict(m) for m in messages]
    joined[1]["content"] = "What is the capital\nof France?"
    assert tokenize(http, messages=messages)["tokens"] == tokenize(http, messages=joined)["tokens"]
    assert r.usage.prompt_tokens == tokenize(http, messages=joined)["count"]
    # `reasoning` is accepted on input as well.
    messages[2] = {"role": "assistant", "content": "Paris.", "reasoning": "Easy."}
    assert client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2).choices[0].message.content is not None


def test_tools_and_tool_messages(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            # As the API returned it: no content (SmolLM2's template concatenates content, so the
            # server passes "" as vLLM does) and the arguments as a JSON string.
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    for choice in ("auto", "none", None):
        kw = {"tool_choice": choice} if choice else {}
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=tools, parallel_tool_calls=False, max_tokens=8, temperature=0, **kw
        )
        assert r.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=8
        )
    assert e.value.body["param"] == "tool_choice"
    broken = [dict(m) for m in messages]
    broken[1] = {**messages[1], "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}}]}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=broken, tools=tools, max_tokens=8)
    assert e.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def weather_tools():
    return [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    ]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_returns_tool_calls(client, choice):
    messages = [{"role": "user", "content": "What time is it in Paris?"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=weather_tools(), tool_choice=choice, max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments), dict)
    # Streaming delivers the same call as it is generated: its id and name first, then the
    # arguments' text, with every token's logprobs.
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=weather_tools(), tool_choice=choice,
                                                 max_tokens=60, temperature=0, stream=True, logprobs=True,
                                                 stream_options={"include_usage": True}))
    deltas = [tc for ch in chunks for c2 in ch.choices for tc in (c2.delta.tool_calls or [])]
    assert deltas[0].function.name == call.function.name and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert len(deltas) > 1 and all(d.id is None and d.function.name is None and d.index == 0 for d in deltas[1:])
    assert json.loads("".join(d.function.arguments for d in deltas)) == json.loads(call.function.arguments)
    assert [c2.finish_reason for ch in chunks for c2 in ch.choices if c2.finish_reason] == ["tool_calls"]
    logprobs = [e for ch in chunks for c2 in ch.choices if c2.logprobs for e in c2.logprobs.content]
    assert len(logprobs) == chunks[-1].usage.completion_tokens


def test_response_format_reasoning_effort_and_template_kwargs(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Reply with a JSON object with key 'city'."}],
        response_format={"type": "json_object"},
        reasoning_effort="low",
        max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].message.content is not None


def test_chat_with_raw_httpx_no_model_field(http):
    r = http.post("/v1/chat/completions", json={"messages": capital_messages(), "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": PARIS}
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_text_held_for_a_stop_prefix_is_released_at_eos(client):
    # "." could start the stop string ".!", so the engine holds it back; EOS then ends the choice.
    r = client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), temperature=0, stop=[".!"])
    assert r.choices[0].message.content == PARIS


def test_response_format_json_object_is_enforced(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Give me a JSON object describing a cat with keys name and age."}],
        temperature=0,
        max_tokens=100,
        response_format={"type": "json_object"},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


CAT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "colour": {"enum": ["black", "white", "ginger"]},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "toys"],
    "additionalProperties": False,
}


def check_cat(content):
    cat = json.loads(content)
    assert list(cat) == ["name", "age", "colour", "toys"], cat
    assert isinstance(cat["name"], str) and len(cat["name"]) <= 12
    assert isinstance(cat["age"], int) and cat["colour"] in ("black", "white", "ginger")
    assert len(cat["toys"]) <= 3 and all(isinstance(t, str) and len(t) <= 10 for t in cat["toys"])


def test_response_format_json_schema_is_enforced(client):
    messages = [{"role": "user", "content": "Describe a cat as JSON."}]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT_SCHEMA, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    check_cat(r.choices[0].message.content)
    # vLLM's spelling, sampled and streamed: still the schema's shape.
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=1.0, seed=3, max_tokens=120, stream=True,
        extra_body={"structured_outputs": {"json": CAT_SCHEMA}},
    )
    check_cat("".join(c.choices[0].delta.content or "" for c in stream if c.choices))


def insignificant_whitespace(text):
    """The whitespace bytes of JSON text outside its strings."""
    found, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in " \n\t\r":
            found.append(ch)
    return found


def test_disable_any_whitespace_makes_compact_json(client, http):
    messages = [{"role": "user", "content": "Describe a cat as JSON."}]
    so = {"disable_any_whitespace": True}
    asks = [
        {"extra_body": {"structured_outputs": {"json": CAT_SCHEMA, **so}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT_SCHEMA}}, "extra_body": {"structured_outputs": so}},
    ]
    spaced = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=120,
                                            extra_body={"structured_outputs": {"json": CAT_SCHEMA}}).choices[0].message.content
    assert insignificant_whitespace(spaced), "greedy SmolLM2 pads JSON when it may (else this test shows nothing)"
    for ask in asks:
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=120, **ask)
        content = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", content
        check_cat(content)
        assert insignificant_whitespace(content) == [], content
        assert r.usage.completion_tokens < len(tokenize(http, prompt=spaced, add_special_tokens=False)["tokens"])
    # A forced tool call's JSON too: the same call in fewer tokens.
    call = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=weather_tools(),
                tool_choice="required", temperature=0, max_tokens=100)
    padded, compact = (client.chat.completions.create(**call, **extra) for extra in ({}, {"extra_body": {"structured_outputs": so}}))
    assert padded.choices[0].finish_reason == compact.choices[0].finish_reason == "tool_calls"
    assert compact.usage.completion_tokens < padded.usage.completion_tokens, (compact.usage, padded.usage)
    # json_object, on the text endpoint too.
    for path, body in [
        ("/v1/chat/completions", {"messages": messages}),
        ("/v1/completions", {"prompt": "A cat as a JSON object:"}),
    ]:
        r = http.post(path, json={**body, "max_tokens": 80, "temperature": 0, "structured_outputs": {"json_object": True, **so}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop", text
        assert isinstance(json.loads(text), dict) and insignificant_whitespace(text) == [], text


def test_allowed_token_ids_limit_what_is_sampled(client, http):
    allowed = [tokenize(http, prompt=w, add_special_tokens=False)["tokens"][0] for w in (" Lyon", " Nice", " banana")]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=capital_messages(), max_tokens=6, temperature=1.0, seed=3, extra_body={"allowed_token_ids": allowed, "return_token_ids": True}
    )
    ids = r.choices[0].model_dump()["token_ids"]
    assert len(ids) == 6 and set(ids) <= set(allowed), ids
    # Greedy text completion: not the model's favourite (" Paris"), but one of the allowed.
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=1, temperature=0, extra_body={"allowed_token_ids": allowed})
    assert r.choices[0].text in {http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in allowed}, r.choices[0].text
    for bad in ([], [10**7]):
        r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": capital_messages(), "max_tokens": 2, "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_continue_final_message_prefills_the_answer(client, http):
    messages = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital of France is"}]
    open_ = tokenize(http, messages=messages, continue_final_message=True)
    assert http.post("/detokenize", json={"tokens": open_["tokens"]}).json()["prompt"].endswith("<|im_start|>assistant\nThe capital of France is")
    closed = tokenize(http, messages=messages, add_generation_prompt=False)
    assert closed["tokens"][: open_["count"]] == open_["tokens"] and closed["count"] > open_["count"]  # the end of turn is gone
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0, extra_body={"continue_final_message": True})
    assert r.usage.prompt_tokens == open_["count"] and r.choices[0].message.content.startswith(" Paris"), r.choices[0].message.content
    raw = client.completions.create(model=MODEL_NAME, prompt=open_["tokens"], max_tokens=3, temperature=0)
    assert r.choices[0].message.content == raw.choices[0].text
    both = {"continue_final_message": True, "add_generation_prompt": True}
    blank = messages[:1] + [{"role": "assistant", "content": "  "}]
    for extra, msgs in ((both, messages), ({"continue_final_message": True}, blank)):
        r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": msgs, "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, http):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [c.model_dump() for c in client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=5, temperature=0, stream=True, stream_options=opts)]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    assert len({u["prompt_tokens"] for u in usages}) == 1
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 5, done
    # Each content chunk counts at least the tokens whose text it carries.
    texts = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert all(c["usage"]["completion_tokens"] >= i + 1 for i, c in enumerate(texts))
    # Plain include_usage: null until the final usage chunk.
    plain = [c.usage for c in client.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=3, stream=True, stream_options={"include_usage": True})]
    assert all(u is None for u in plain[:-1]) and plain[-1].completion_tokens == 3


def test_int8_cpu_activations_serve_one_answer_whatever_the_batch_and_bad_modes_are_refused():
    # `--cpu-activations int8`: the Q4_1/Q8_0 layers take 8-bit inputs (llama.cpp's arithmetic).
    # The greedy answer is the same streamed or not, alone or beside other requests (the int8
    # kernels are batch-invariant too). It need not be the f32 answer: this question's first
    # token is a near-tie ("The" leads "L" by 0.08 nats with f32 activations; int8 swaps them).
    # An unknown mode stops the server before it binds, naming the valid ones.
    from concurrent.futures import ThreadPoolExecutor
    import subprocess

    from conftest import BINARY, MODEL, Server

    s = Server("int8-activations", ["--cpu-activations", "int8"]).start()
    try:
        assert "cpu_activations=int8" in s.log_text()
        c = s.client()
        body = dict(model=MODEL_NAME, messages=capital_messages(), temperature=0, max_tokens=12)
        ask = lambda: c.chat.completions.create(**body).choices[0].message.content
        alone = ask()
        assert alone.strip(), alone
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda _: ask(), range(4))) == [alone] * 4
        chunks = c.chat.completions.create(**body, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == alone
    finally:
        s.stop()
    bad = subprocess.run([str(BINARY), "serve", "--model", str(MODEL), "--cpu-activations", "int4"], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "int4" in bad.stderr and "f32" in bad.stderr and "int8" in bad.stderr, bad.stderr
