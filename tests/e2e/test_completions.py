"""Text completions (the legacy API) through the openai client."""

import json
import shutil

import httpx
import pytest

from conftest import MODEL_NAME, ROOT, Server

PROMPT = "The capital of France is"


def count(http, text, add_special_tokens=True):
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": add_special_tokens}).json()["count"]


def test_completion_non_stream(client, http):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.text == " Paris.\n\n"
    assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == count(http, PROMPT)
    assert r.usage.completion_tokens == 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4


def test_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length"


def test_completion_stream_matches(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 12


def test_multiple_prompts_and_n(client, http):
    prompts = ["The capital of France is", "1, 2, 3,"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == " Paris.\n\nThe"
    assert r.choices[2].text == r.choices[3].text != r.choices[0].text
    assert r.usage.prompt_tokens == sum(count(http, p) for p in prompts)
    assert r.usage.completion_tokens == 4 * 5


def test_token_id_prompt_and_echo(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].text == " Paris.\n\n"
    assert r.usage.prompt_tokens == len(ids)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + " Paris."


def test_stop_and_seed(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, stop=["."])
    assert r.choices[0].text == " Paris"
    assert r.choices[0].finish_reason == "stop"

    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt="My favourite food is", max_tokens=16, temperature=1.0, seed=seed).choices[0].text

    assert sample(99) == sample(99)


def test_include_stop_str_in_output(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, stop=["."], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == " Paris."
    assert r.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, stop=["."], stream=True, extra_body={"include_stop_str_in_output": True}
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == " Paris."


def test_min_tokens_holds_off_stop_ids_and_strings(client, http):
    # Token 1000 biased to the top and made a stop id: it ends generation at once, unless
    # min_tokens masks it, and then it is the first token after the minimum.
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    forced = {"logit_bias": {"1000": 100}, "stop_token_ids": [1000]}
    r = client.completions.create(**body, extra_body=forced)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (1, "stop")
    r = client.completions.create(**body, extra_body={**forced, "min_tokens": 5})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (6, "stop")
    # The "." of " Paris." comes before the minimum: generation goes on past it.
    r = client.completions.create(**body, stop=["."], extra_body={"min_tokens": 4})
    assert r.choices[0].text.startswith(" Paris.") and r.usage.completion_tokens >= 4, r.choices[0].text
    r = http.post("/v1/completions", json={**body, "min_tokens": 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_truncate_prompt_tokens_keeps_the_prompt_tail(client, http):
    ids = list(range(100, 120))
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0, echo=True, extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    tail = http.post("/detokenize", json={"tokens": ids[-5:]}).json()["prompt"]
    assert r.choices[0].text.startswith(tail)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello there"}], max_tokens=2, extra_body={"truncate_prompt_tokens": 3}
    )
    assert r.usage.prompt_tokens == 3
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 20, r.text
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_structured_outputs_in_text_completions(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"structured_outputs": {"choice": ["Lyon", "Nice"]}})
    assert r.choices[0].text in ("Lyon", "Nice")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}}, "required": ["city", "population"]}
    r = client.completions.create(model=MODEL_NAME, prompt="Paris as JSON:", max_tokens=60, temperature=0, extra_body={"guided_json": schema})
    out = json.loads(r.choices[0].text)
    assert list(out) == ["city", "population"] and isinstance(out["population"], int), out


def test_echo_with_logprobs_scores_the_prompt_like_transformers(client, http):
    # lm-evaluation-harness's loglikelihood request: echo + logprobs, one generated token. The
    # prompt's scores are checked against transformers' logits (tests/reference/smollm2): the
    # same best token at every position, and logprob differences equal to logit differences.
    fx = json.loads((ROOT / "tests/reference/smollm2/fixtures.json").read_text())["prompts"][0]
    ids = fx["ids"]
    piece = lambda t: http.post("/detokenize", json={"tokens": [t]}).json()["prompt"]
    body = dict(model=MODEL_NAME, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=5)
    lp = client.completions.create(**body).choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[:3] == [piece(t) for t in ids[:3]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        top = {piece(t): logit for t, logit in fx["logits_top"][j - 1]}
        best_piece, best_logit = piece(fx["logits_top"][j - 1][0][0]), fx["logits_top"][j - 1][0][1]
        ours = lp.top_logprobs[j]
        assert len(ours) == 5 and max(ours, key=ours.get) == best_piece, (j, ours)
        assert len(set(ours) & set(list(top)[:5])) >= 4, (j, ours, top)
        for p_, l in ours.items():
            if p_ in top:
                assert abs((l - ours[best_piece]) - (top[p_] - best_logit)) < 3e-3, (j, p_)
        if piece(ids[j]) in top:
            assert abs((lp.token_logprobs[j] - ours[best_piece]) - (top[piece(ids[j])] - best_logit)) < 3e-3, j
        assert lp.token_logprobs[j] <= 0
    # A repeat is a prefix-cache hit for plain requests; scoring computes the prompt again.
    again = client.completions.create(**body).choices[0].logprobs
    assert again.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(again.token_logprobs[1:-1], lp.token_logprobs[1:-1])) < 1e-4
    # Several prompts and n: each choice carries its own prompt's scores; a one-token prompt has none.
    r = client.completions.create(model=MODEL_NAME, prompt=[ids[:6], ids[:1]], n=2, max_tokens=1, temperature=0, echo=True, logprobs=0)
    assert [len(c.logprobs.tokens) for c in r.choices] == [7, 7, 2, 2]
    assert max(abs(a - b) for a, b in zip(r.choices[1].logprobs.token_logprobs[1:6], lp.token_logprobs[1:6])) < 1e-4
    assert r.choices[2].logprobs.token_logprobs[0] is None
    # Streamed, the echo waits for its scores and carries them; offsets run on into the answer.
    whole = client.completions.create(**body).choices[0]
    text, tokens, lps, offsets = "", [], [], []
    for ch in client.completions.create(**body, stream=True):
        for c in ch.choices:
            text += c.text
            if c.logprobs:
                tokens, lps, offsets = tokens + c.logprobs.tokens, lps + c.logprobs.token_logprobs, offsets + c.logprobs.text_offset
    assert text == whole.text and tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert lps[0] is None and max(abs(a - b) for a, b in zip(lps[1:], whole.logprobs.token_logprobs[1:])) < 1e-4


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, http):
    # OpenAI's legacy way to score a text (HELM and older harnesses send it): echo, no tokens.
    ids = json.loads((ROOT / "tests/reference/smollm2/fixtures.json").read_text())["prompts"][0]["ids"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    body = dict(model=MODEL_NAME, prompt=ids, echo=True, temperature=0)
    c = client.completions.create(**body, max_tokens=0, logprobs=2).choices[0]
    assert c.text == text and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    one = client.completions.create(**body, max_tokens=1, logprobs=2).choices[0].logprobs
    assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs[1:], one.token_logprobs[1 : len(ids)])) < 1e-4
    chunks = [ch for ch in client.completions.create(**body, max_tokens=0, stream=True, logprobs=1) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == text and chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks if ch.choices[0].logprobs) == len(ids)
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_vllm_prompt_logprobs_rank_the_prompt_like_transformers(client, http):
    # vLLM's prompt_logprobs: null for the first token, then {token id: {logprob, rank,
    # decoded_token}} holding the prompt token first and the k best. Ranks are checked against
    # transformers' logits where the neighbours are not too close to call; logprobs against
    # the echo scores (themselves checked against transformers above).
    fx = json.loads((ROOT / "tests/reference/smollm2/fixtures.json").read_text())["prompts"][0]
    ids = fx["ids"]
    piece = lambda t: http.post("/detokenize", json={"tokens": [t]}).json()["prompt"]
    body = dict(model=MODEL_NAME, prompt=ids, max_tokens=1, temperature=0)
    r = http.post("/v1/completions", json={**body, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    echo = client.completions.create(**body, echo=True, logprobs=3).choices[0].logprobs
    checked_ranks = 0
    for j in range(1, len(ids)):
        row, own = pl[j], str(ids[j])
        assert list(row)[0] == own and len(row) in (3, 4), (j, row)
        assert abs(row[own]["logprob"] - echo.token_logprobs[j]) < 1e-4, j
        assert row[own]["decoded_token"] == piece(ids[j])
        assert sorted(v["rank"] for v in row.values() if v["rank"] <= 3) == [1, 2, 3], (j, row)
        assert {piece(int(k)) for k, v in row.items() if v["rank"] <= 3} == set(echo.top_logprobs[j]), j
        ref = fx["logits_top"][j - 1]
        pos = [t for t, _ in ref].index(ids[j]) if ids[j] in [t for t, _ in ref] else None
        if pos is not None and all(abs(ref[pos][1] - l) > 0.05 for t, l in ref if t != ids[j]):
            assert row[own]["rank"] == pos + 1, (j, row[own], pos)
            checked_ranks += 1
    assert checked_ranks >= 5
    # Chat puts them beside the choices; together with echo + logprobs each keeps its own width.
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "n": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(row) == 1 for row in chat["prompt_logprobs"][1:])
    both = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1, "prompt_logprobs": 4}).json()["choices"][0]
    assert all(len(t) == 1 for t in both["logprobs"]["top_logprobs"][1:])
    assert all(len(row) >= 4 for row in both["prompt_logprobs"][1:])
    # Streaming has no place for them; over the logprobs cap (and -1, the whole vocabulary) is refused.
    for extra in ({"stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": -2}):
        r = http.post("/v1/completions", json={**body, "prompt_logprobs": 1, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", (extra, r.text)
    # Every choice repeats its prompt's scores: a response of gigabytes is refused up front.
    r = http.post("/v1/completions", json={**body, "prompt": [100] * 2000, "n": 16, "prompt_logprobs": 20})
    assert r.status_code == 400 and "logprob entries" in r.json()["error"]["message"], r.text


def test_known_fields_that_cannot_be_honoured_are_refused(http):
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json={**chat, "chat_template": "{{ messages[0].content }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert http.post("/v1/chat/completions", json={**chat, "prompt_logprobs": None, "chat_template": None}).status_code == 200


def test_legacy_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == 4 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert [max(t, key=t.get) for t in lp.top_logprobs] == lp.tokens  # greedy
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets


def test_legacy_logprobs_stream(client):
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, stream=True)
    tokens, offsets = [], []
    for c in stream:
        if c.choices and c.choices[0].logprobs:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
    assert "".join(tokens) == " Paris.\n\n"
    assert offsets == [0, 6, 7, 8]


def test_vllm_token_ids_beside_the_text(client, http):
    # return_token_ids: the prompt's and the answer's ids (streamed: each chunk the ids it
    # completes, the first one the prompt's); return_tokens_as_token_ids: logprobs name
    # tokens "token_id:<id>" while text_offset still indexes the text.
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, extra_body=extra)
    c = client.completions.create(**body).choices[0].model_dump()
    assert c["prompt_token_ids"] == prompt_ids and len(c["token_ids"]) == 4
    assert http.post("/detokenize", json={"tokens": c["token_ids"]}).json()["prompt"] == c["text"] == " Paris.\n\n"
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert [list(t) for t in c["logprobs"]["top_logprobs"]] == [[f"token_id:{t}"] for t in c["token_ids"]]  # greedy
    assert c["logprobs"]["text_offset"] == [0, 6, 7, 8]
    chunks = [ch.choices[0].model_dump() for ch in client.completions.create(**body, stream=True) if ch.choices]
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all(ch.get("prompt_token_ids") is None for ch in chunks[1:])
    assert sum((ch["token_ids"] for ch in chunks), []) == c["token_ids"]
    # An echo without generation answers with the prompt alone: no answer ids.
    e = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, extra_body=extra).choices[0].model_dump()
    assert e["token_ids"] == [] and e["prompt_token_ids"] == prompt_ids

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_body = dict(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True, extra_body=extra)
    r = client.chat.completions.create(**chat_body).model_dump()
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    ids = r["choices"][0]["token_ids"]
    assert len(ids) == r["usage"]["completion_tokens"] == 5
    assert [x["token"] for x in r["choices"][0]["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]
    chunks = [ch.model_dump() for ch in client.chat.completions.create(**chat_body, stream=True)]
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"] and all(ch.get("prompt_token_ids") is None for ch in chunks[1:])
    assert sum((ch["choices"][0]["token_ids"] for ch in chunks if ch["choices"]), []) == ids
    # Without the flags, none of it.
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1).choices[0].model_dump()
    assert plain.get("token_ids") is None and not plain["logprobs"]["tokens"][0].startswith("token_id:")


def test_add_special_tokens_decides_whether_the_tokenizer_adds_its_bos(tmp_path):
    # SmolLM2's tokenizer adds nothing, so this serves the tiny Llama with a tokenizer that
    # prepends a BOS (id 0): text prompts get it by default, chats (whose template writes their
    # own special tokens) only when asked.
    model = tmp_path / "tiny-llama-bos"
    shutil.copytree(ROOT / "tests" / "reference" / "tiny_llama", model)
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (model / "tokenizer.json").write_text(json.dumps(tok))
    s = Server("tiny-bos")
    s.args[s.args.index("--model") + 1] = str(model)
    s.start()
    try:
        post = lambda path, body: httpx.post(s.url + path, json={"max_tokens": 1, "return_token_ids": True, **body}, timeout=60).json()
        with_bos = post("/v1/completions", {"prompt": "hello world"})["choices"][0]["prompt_token_ids"]
        without = post("/v1/completions", {"prompt": "hello world", "add_special_tokens": False})["choices"][0]["prompt_token_ids"]
        assert with_bos[0] == 0 and with_bos[1:] == without and without[0] != 0, (with_bos, without)
        messages = [{"role": "user", "content": "hello"}]
        chat = post("/v1/chat/completions", {"messages": messages})["prompt_token_ids"]
        chat_bos = post("/v1/chat/completions", {"messages": messages, "add_special_tokens": True})["prompt_token_ids"]
        assert chat[0] == 1 and chat_bos == [0] + chat, (chat, chat_bos)
    finally:
        s.stop()
