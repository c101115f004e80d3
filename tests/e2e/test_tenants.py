"""Multi-tenancy against the real server and database (`serve --db`): API keys made with the CLI,
401s for missing/invalid/revoked/expired keys, the model allow-list (404), rpm/tpm/concurrency
limits under concurrent load (429 + Retry-After + x-ratelimit-*), usage rows equal to the
responses' usage, keys never in clear in logs or the database, usage surviving kill -9, the
admin API (403 for tenant keys), and per-tenant fairness of time to first token.
"""

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import BINARY, LOG_DIR, MODEL_NAME, Server

ADMIN_KEY = "admin-" + os.urandom(16).hex()
DB_DIR = LOG_DIR / "tenants"
DB = DB_DIR / "tenancy.db"
ALL_KEYS = []  # every key handed out, to check none is stored or logged in clear


def cli(*args, check=True):
    p = subprocess.run([str(BINARY), *args, "--db", str(DB)], capture_output=True, text=True, timeout=60)
    if check:
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)
    return p


def new_tenant(tid, *flags):
    return cli("tenants", "create", tid, *flags)


def new_key(tenant, *flags):
    k = cli("keys", "create", "--tenant", tenant, *flags)
    ALL_KEYS.append(k["key"])
    return k


def start_server(name, *extra):
    return Server(name, ["--db", str(DB), *extra], env={"WASMSERVE_ADMIN_KEY": ADMIN_KEY}).start()


@pytest.fixture(scope="module")
def tsrv():
    DB_DIR.mkdir(parents=True, exist_ok=True)
    for f in DB_DIR.glob("tenancy.db*"):
        f.unlink()
    s = start_server("tenants")
    yield s
    s.stop()


def client(srv, key, **kw):
    return srv.client(api_key=key, **kw)


def complete(srv, key, **kw):
    kw.setdefault("model", MODEL_NAME)
    kw.setdefault("prompt", "Hello")
    kw.setdefault("max_tokens", 2)
    return client(srv, key).completions.create(**kw)


def test_missing_invalid_revoked_expired_keys_get_401(tsrv):
    new_tenant("auth")
    good = new_key("auth")["key"]
    assert complete(tsrv, good).usage.completion_tokens > 0
    r = httpx.post(tsrv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for bad in ["nope", good[:-1] + ("0" if good[-1] != "0" else "1"), "wsk-000000000000-" + "0" * 64, ADMIN_KEY]:
        with pytest.raises(openai.AuthenticationError):
            complete(tsrv, bad)
    expired = new_key("auth", "--expires-at", str(int(time.time()) - 1))["key"]
    with pytest.raises(openai.AuthenticationError):
        complete(tsrv, expired)
    # Revocation (CLI on the live database file) takes effect on the very next request.
    k = new_key("auth")
    complete(tsrv, k["key"])
    cli("keys", "revoke", k["id"])
    with pytest.raises(openai.AuthenticationError):
        complete(tsrv, k["key"])
    with pytest.raises(openai.AuthenticationError):
        client(tsrv, k["key"]).models.list()
    # A disabled tenant's keys stop too.
    new_tenant("auth-off")
    off = new_key("auth-off")["key"]
    complete(tsrv, off)
    cli("tenants", "disable", "auth-off")
    with pytest.raises(openai.AuthenticationError):
        complete(tsrv, off)


def test_model_outside_allow_list_is_404(tsrv):
    new_tenant("restricted", "--models", "some-other-model")
    key = new_key("restricted")["key"]
    c = client(tsrv, key)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve(MODEL_NAME)
    assert [m.id for m in c.models.list()] == []
    # A key-level allow-list narrows an otherwise unrestricted tenant.
    new_tenant("open")
    narrowed = new_key("open", "--models", "x")["key"]
    with pytest.raises(openai.NotFoundError):
        complete(tsrv, narrowed)
    assert [m.id for m in client(tsrv, new_key("open")["key"]).models.list()] == [MODEL_NAME]


async def burst(url, key, n, body):
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=n)) as c:
        async def one():
            return await c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})

        return await asyncio.gather(*[one() for _ in range(n)])


def test_rpm_holds_exactly_under_50_concurrent(tsrv):
    new_tenant("rpm", "--rpm", "20")
    key = new_key("rpm")["key"]
    rs = asyncio.run(burst(tsrv.url, key, 50, {"prompt": "Hi", "max_tokens": 1}))
    ok = [r for r in rs if r.status_code == 200]
    limited = [r for r in rs if r.status_code == 429]
    assert len(ok) == 20 and len(limited) == 30, [r.status_code for r in rs]
    for r in limited:
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-limit-requests"] == "20"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert r.json()["error"]["type"] == "rate_limit_error"
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok)
    assert remaining == list(range(20)), remaining
    # The openai client sees a RateLimitError with the headers.
    with pytest.raises(openai.RateLimitError) as e:
        complete(tsrv, key)
    assert "retry-after" in e.value.response.headers


def test_tpm_holds_exactly_under_50_concurrent(tsrv):
    # Each request reserves 10 prompt tokens + 5 completion tokens = 15; 7 fit in 110.
    new_tenant("tpm", "--tpm", "110")
    key = new_key("tpm")["key"]
    body = {"prompt": list(range(100, 110)), "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    rs = asyncio.run(burst(tsrv.url, key, 50, body))
    ok = [r for r in rs if r.status_code == 200]
    assert len(ok) == 7 and sum(r.status_code == 429 for r in rs) == 43, [r.status_code for r in rs]
    assert sum(r.json()["usage"]["total_tokens"] for r in ok) == 105
    for r in rs:
        assert r.headers["x-ratelimit-limit-tokens"] == "110"
        assert "x-ratelimit-remaining-tokens" in r.headers and "x-ratelimit-reset-tokens" in r.headers
    # Settlement: a request that stops early (EOS/stop) gives its unused reservation back.
    new_tenant("tpm-settle", "--tpm", "40")
    k2 = new_key("tpm-settle")["key"]
    r = complete(tsrv, k2, prompt=list(range(100, 110)), max_tokens=20, stop=None, extra_body={"ignore_eos": True}, temperature=0)
    assert r.usage.total_tokens == 30
    # 30 used of 40: a request reserving 15 is refused, one reserving 10 fits.
    with pytest.raises(openai.RateLimitError):
        complete(tsrv, k2, prompt=list(range(100, 110)), max_tokens=5)
    complete(tsrv, k2, prompt=list(range(100, 105)), max_tokens=5, extra_body={"ignore_eos": True})


def test_concurrency_limit(tsrv):
    new_tenant("conc", "--max-concurrent", "2")
    key = new_key("conc")["key"]
    c = client(tsrv, key)
    streams = [c.completions.create(model=MODEL_NAME, prompt="Count:", max_tokens=200, stream=True, extra_body={"ignore_eos": True}) for _ in range(2)]
    for s in streams:
        next(iter(s))
    with pytest.raises(openai.RateLimitError) as e:
        complete(tsrv, key)
    assert "concurrent" in e.value.message
    for s in streams:
        s.close()
    deadline = time.time() + 10
    while True:
        try:
            complete(tsrv, key)
            break
        except openai.RateLimitError:
            assert time.time() < deadline
            time.sleep(0.05)


def test_max_context_and_token_budget(tsrv):
    new_tenant("ctx", "--max-context", "20")
    key = new_key("ctx")["key"]
    r = complete(tsrv, key, prompt=list(range(100, 110)), max_tokens=50, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        complete(tsrv, key, prompt=list(range(100, 125)))
    new_tenant("budget", "--token-budget", "40", "--budget-window", "3600")
    bk = new_key("budget")["key"]
    for _ in range(2):
        complete(tsrv, bk, prompt=list(range(100, 110)), max_tokens=5, extra_body={"ignore_eos": True})
    with pytest.raises(openai.RateLimitError) as e:
        complete(tsrv, bk, prompt=list(range(100, 110)), max_tokens=5)
    assert "budget" in e.value.message
    assert int(e.value.response.headers["retry-after"]) <= 3600
    # A request larger than the whole budget can never be admitted: a 400 naming the limit (not a
    # 429 the SDKs would retry for nothing).
    fresh = new_key("budget")["key"]
    r = httpx.post(tsrv.url + "/v1/completions", headers={"Authorization": f"Bearer {fresh}"},
                   json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large" and "budget" in r.text, r.text


def test_invalid_requests_are_400_before_limits_and_zero_limits_refuse(tsrv):
    # A request the engine refuses is the client's 400, even where the token limits would refuse
    # it too (a huge n would otherwise count as a huge token reservation: "Request too large", 429).
    new_tenant("strict-tpm", "--tpm", "50")
    key = new_key("strict-tpm")["key"]
    for body in [{"prompt": "Hello", "n": 10**15}, {"prompt": "Hello", "logprobs": 50}, {"prompt": ""}]:
        r = httpx.post(tsrv.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={"model": MODEL_NAME, "max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
    complete(tsrv, key)
    # More tokens than the tpm limit allows in a whole minute: never admissible, so a 400.
    r = httpx.post(tsrv.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large" and "tokens per minute" in r.text, r.text
    assert "retry-after" not in r.headers
    # An rpm of 0 switches a key off: 429 with Retry-After, and the server goes on serving.
    new_tenant("off", "--rpm", "0")
    off = new_key("off")["key"]
    with pytest.raises(openai.RateLimitError) as e:
        complete(tsrv, off)
    assert int(e.value.response.headers["retry-after"]) >= 1
    # A limit that refuses any request at all refuses before the prompt is tokenized or the chat
    # rendered: even an empty prompt (a 400 above) and an 8 MB-limit-sized chat are a quick 429.
    h = {"Authorization": f"Bearer {off}"}
    r = httpx.post(tsrv.url + "/v1/completions", headers=h, json={"model": MODEL_NAME, "prompt": "", "max_tokens": 2})
    assert r.status_code == 429, r.text
    big = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "word " * 1_500_000}], "max_tokens": 2}
    t = time.time()
    assert httpx.post(tsrv.url + "/v1/chat/completions", headers=h, json=big, timeout=60).status_code == 429
    assert time.time() - t < 2, "the refusal waited for the 7.5 MB prompt to be rendered and tokenized"
    complete(tsrv, key)
    # A bad query string is an OpenAI-style 400, not axum's plain text.
    r = httpx.get(tsrv.url + "/v1/usage", params={"limit": "abc"}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert "query" in r.json()["error"]["message"]


def test_tokenizer_endpoints_count_against_the_request_rate(tsrv):
    # Rendering a chat runs the template (maybe a tenant's plugin) on the server: /tokenize and
    # /detokenize are requests like any other for rpm and concurrency, though they use no tokens.
    new_tenant("tok", "--rpm", "2")
    key = new_key("tok")["key"]
    h = {"Authorization": f"Bearer {key}"}
    r = httpx.post(tsrv.url + "/tokenize", headers=h, json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    assert r.headers["x-ratelimit-remaining-requests"] == "1"
    assert httpx.post(tsrv.url + "/detokenize", headers=h, json={"tokens": [100]}).status_code == 200
    r = httpx.post(tsrv.url + "/tokenize", headers=h, json={"prompt": "Hi"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        complete(tsrv, key)
    # A key switched off with rpm 0 cannot tokenize either.
    new_tenant("tok-off", "--rpm", "0")
    off = new_key("tok-off")["key"]
    assert httpx.post(tsrv.url + "/tokenize", headers={"Authorization": f"Bearer {off}"}, json={"prompt": "Hi"}).status_code == 429
    # No usage row: the tenant's usage lists nothing for them (the admin asks: the key's own
    # usage reports count against its spent request rate too).
    rows = httpx.get(tsrv.url + "/admin/usage", params={"tenant": "tok"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert rows["totals"]["requests"] == 0, rows
    assert httpx.get(tsrv.url + "/v1/usage", headers=h).status_code == 429


def test_usage_reports_count_against_the_request_rate(tsrv):
    # A report reads the database: a key cannot query its usage in a loop without limit.
    new_tenant("reports", "--rpm", "2")
    key = new_key("reports")["key"]
    h = {"Authorization": f"Bearer {key}"}
    r = httpx.get(tsrv.url + "/v1/usage", headers=h)
    assert r.status_code == 200 and r.json()["totals"]["requests"] == 0, r.text
    assert r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "1"
    assert complete(tsrv, key).usage.total_tokens > 0
    r = httpx.get(tsrv.url + "/v1/usage", headers=h)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    # Only the completion left a usage row; the admin's reports are not limited.
    rows = httpx.get(tsrv.url + "/admin/usage", params={"tenant": "reports"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert rows["totals"]["requests"] == 1, rows


def test_usage_rows_equal_responses(tsrv):
    new_tenant("acct")
    key = new_key("acct")["key"]
    other = new_key("auth")["key"]
    c = client(tsrv, key)
    seen = {}
    r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4)
    seen[r.id] = r.usage
    r = c.completions.create(model=MODEL_NAME, prompt=["One", "Two"], n=2, max_tokens=3)
    seen[r.id] = r.usage
    r = c.completions.create(model=MODEL_NAME, prompt="Say hi", max_tokens=4)  # prefix-cache hit on the repeat
    r = c.completions.create(model=MODEL_NAME, prompt="Say hi", max_tokens=4)
    seen[r.id] = r.usage
    for _ in range(2):
        stream = c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        usage, rid = None, None
        for chunk in stream:
            rid = chunk.id
            usage = chunk.usage or usage
        seen[rid] = usage
    # The row is committed before the response completes: readable at once.
    mine = httpx.get(tsrv.url + "/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    rows = {row["request_id"]: row for row in mine["data"]}
    assert len(rows) == 6 and all(row["tenant_id"] == "acct" and row["status"] == "ok" for row in rows.values())
    for rid, u in seen.items():
        row = rows[rid]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (u.prompt_tokens, u.completion_tokens), (row, u)
        assert row["cached_tokens"] == (u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0)
        assert row["model"] == MODEL_NAME and row["latency_ms"] >= 0
    assert mine["totals"]["requests"] == 6
    assert mine["totals"]["total_tokens"] == sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows.values())
    # Tenants see only their own usage; the admin sees any.
    theirs = httpx.get(tsrv.url + "/v1/usage", headers={"Authorization": f"Bearer {other}"}).json()
    assert all(row["tenant_id"] == "auth" for row in theirs["data"])
    adm = httpx.get(tsrv.url + "/admin/usage", params={"tenant": "acct"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert {row["request_id"] for row in adm["data"]} == set(rows)


def test_admin_api(tsrv):
    h = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=tsrv.url, timeout=30) as c:
        assert c.get("/admin/keys").status_code == 401
        assert c.get("/admin/keys", headers={"Authorization": "Bearer wrong"}).status_code == 401
        tenant_key = new_key("auth")["key"]
        r = c.get("/admin/tenants", headers={"Authorization": f"Bearer {tenant_key}"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        r = c.post("/admin/tenants", headers=h, json={"id": "via-api", "weight": 2, "rpm": 100, "models": [MODEL_NAME], "request_policy": "policy-a", "parser": "hermes"})
        assert r.status_code == 201, r.text
        assert r.json()["request_policy"] == "policy-a" and r.json()["parser"] == "hermes" and r.json()["rpm"] == 100
        assert c.post("/admin/tenants", headers=h, json={"id": "via-api"}).status_code == 400
        r = c.post("/admin/keys", headers=h, json={"tenant": "via-api", "name": "ci", "expires_in": 3600, "tpm": 1000})
        assert r.status_code == 201, r.text
        created = r.json()
        ALL_KEYS.append(created["key"])
        # Its tenant is bound to request policy "policy-a", which this server does not deploy: the
        # request is refused (fail closed), not served unchecked (tests/e2e/test_admission.py).
        with pytest.raises(openai.APIStatusError) as e:
            complete(tsrv, created["key"])
        assert e.value.status_code == 503 and e.value.body["code"] == "policy_unavailable"
        listed = c.get("/admin/keys", params={"tenant": "via-api"}, headers=h).json()["data"]
        assert [k["id"] for k in listed] == [created["id"]]
        assert "key" not in listed[0] and "key_hash" not in listed[0]
        assert any(t["id"] == "via-api" and t["weight"] == 2 for t in c.get("/admin/tenants", headers=h).json()["data"])
        assert c.delete(f"/admin/keys/{created['id']}", headers=h).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            complete(tsrv, created["key"])
        assert c.delete(f"/admin/keys/{created['id']}", headers=h).status_code == 404
    # The CLI sees the same database, without key material.
    listed = cli("keys", "list", "--tenant", "via-api")
    assert listed[0]["revoked_at"] is not None and "key" not in listed[0]
    assert any(t["id"] == "via-api" for t in cli("tenants", "list"))


def percentile(xs, p):
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def ttft(c, i):
    """Seconds to the first content delta of a small streamed chat request (raw SSE, so the
    client's own overhead stays small next to what is measured)."""
    start = time.perf_counter()
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Name a colour (#{i})."}], "max_tokens": 2, "stream": True}
    first = None
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if any(ch["delta"].get("content") for ch in chunk["choices"]):
                    first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


# The flooding tenant runs in its own process, so its client-side work does not delay the quiet
# tenant's event loop (what is measured is the server, not the test client). Its requests vary in
# length (4-12 tokens): identical lengths admitted together finish together, and the batch would
# turn over in lockstep waves rather than a slot at a time.
FLOOD = r"""
import asyncio, random, sys, httpx
url, key, conc = sys.argv[1], sys.argv[2], int(sys.argv[3])
done = 0
async def worker(c, j):
    global done
    while True:
        r = await c.post("/v1/completions", json={"prompt": f"Tell a story #{j}", "max_tokens": random.randint(4, 12), "ignore_eos": True})
        r.raise_for_status()
        done += 1
        if done % 16 == 0:
            print(done, flush=True)
async def main():
    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}, limits=httpx.Limits(max_connections=conc)) as c:
        await asyncio.gather(*[worker(c, j) for j in range(conc)])
asyncio.run(main())
"""


async def quiet_samples(url, key, samples, base):
    """`samples` requests, each after a random pause (seeded). A quiet tenant's requests arrive
    whenever they do, not in step with the engine: sent back to back, each would arrive just as
    the previous one's last step ended and the flood's next step began, and so would wait a whole
    step every time rather than the remainder of whichever step is running."""
    rng = random.Random(base)
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as c:
        for i in range(samples):
            await asyncio.sleep(rng.uniform(0, 0.25))
            out.append(await ttft(c, base + i))
    return out


def engine_idle(url, timeout=10):
    """Waits until the engine has nothing running or waiting (the killed flood's requests gone)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = httpx.get(url + "/metrics").text
        busy = [ln for ln in m.splitlines() if ln.startswith(("wasmserve_num_requests_running ", "wasmserve_num_requests_waiting "))]
        if busy and all(float(ln.split()[-1]) == 0 for ln in busy):
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not go idle after the flood stopped")


def start_flood(url, flood_key, flood_concurrency, out):
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, url, flood_key, str(flood_concurrency)], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while True:  # wait for the flood to be under way (its first 16 requests done)
        out.seek(0)
        if out.read().strip():
            return flood
        assert flood.poll() is None and time.time() < deadline, "the flood did not start"
        time.sleep(0.1)


def fairness(url, quiet_key, flood_key, rounds=4, samples=8, flood_concurrency=64):
    """Alternates rounds of the quiet tenant alone and under a flood, so the baseline and the
    loaded figures see the same machine (other processes' load drifts over tens of seconds)."""
    alone, loaded, same_tenant, flood_done = [], [], [], 0
    for r in range(rounds):
        engine_idle(url)
        alone += asyncio.run(quiet_samples(url, quiet_key, samples, 100 * r))
        out = open(LOG_DIR / f"tenants-flood-{r}.out", "w+")
        flood = start_flood(url, flood_key, flood_concurrency, out)
        try:
            loaded += asyncio.run(quiet_samples(url, quiet_key, samples, 100 * r + 50))
            if r == rounds - 1:
                # Control: the same requests sent as the flooding tenant queue behind its backlog.
                same_tenant = asyncio.run(quiet_samples(url, flood_key, 1, 1000))
            assert flood.poll() is None, "the flood stopped early"
        finally:
            flood.kill()
            flood.wait()
        out.seek(0)
        lines = out.read().split()
        flood_done += int(lines[-1]) if lines else 0
    return alone, loaded, same_tenant, flood_done


def test_flooding_tenant_does_not_starve_another(tsrv):
    # Batch slots are bounded (8) so the flood queues; the scheduler gives the quiet tenant its share.
    new_tenant("flood")
    new_tenant("quiet")
    flood_key = new_key("flood")["key"]
    quiet_key = new_key("quiet")["key"]
    s = start_server("tenants-fair", "--max-num-seqs", "8")
    try:
        asyncio.run(quiet_samples(s.url, quiet_key, 2, 1000))  # warm up
        alone, loaded, same_tenant, flood_done = fairness(s.url, quiet_key, flood_key)
    finally:
        s.stop()
    p50_alone, p50_loaded = statistics.median(alone), statistics.median(loaded)
    report = {
        "quiet_p50_ttft_alone_s": round(p50_alone, 4),
        "quiet_p50_ttft_with_flood_s": round(p50_loaded, 4),
        "ratio": round(p50_loaded / p50_alone, 2),
        "control_same_tenant_p50_ttft_s": round(statistics.median(same_tenant), 4),
        "flood_concurrency": 64,
        "flood_requests_completed": flood_done,
        "max_num_seqs": 8,
        "rounds": 4,
        "alone": [round(x, 4) for x in alone],
        "with_flood": [round(x, 4) for x in loaded],
    }
    (LOG_DIR / "tenants_fairness.json").write_text(json.dumps(report, indent=2))
    print("fairness:", json.dumps(report))
    assert flood_done > 0
    # The target: at most 2x. The scheduler lets a tenant below its fair share of slots
    # compute its prompt in a step of its own (engine/fair_share.rs), so what remains is the wait
    # for the flood's step in flight when the request arrives (1.44-1.52x measured on the 2-core
    # box). WASMSERVE_FAIRNESS_MAX_RATIO overrides the bound. Without tenant separation (the
    # control) the quiet requests wait behind the whole backlog (~50x).
    bound = float(os.environ.get("WASMSERVE_FAIRNESS_MAX_RATIO", "2"))
    assert p50_loaded <= bound * p50_alone, report
    assert statistics.median(same_tenant) > 3 * p50_loaded, report


def test_usage_survives_kill_9(tsrv):
    new_tenant("durable")
    key = new_key("durable")["key"]
    new_tenant("durable-budget", "--token-budget", "40", "--budget-window", "3600")
    bkey = new_key("durable-budget")["key"]
    body = dict(prompt=list(range(100, 110)), max_tokens=5, extra_body={"ignore_eos": True})
    s = start_server("tenants-kill")
    ids = []
    try:
        c = client(s, key)
        for _ in range(2):
            complete(s, bkey, **body)
        for i in range(5):
            ids.append(c.completions.create(model=MODEL_NAME, prompt=f"Number {i}", max_tokens=2).id)
        stream = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)
        ids.append([ch.id for ch in stream][-1])
    finally:
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait()
        s.log.close()
    s2 = start_server("tenants-kill-restart")
    try:
        rows = httpx.get(s2.url + "/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()["data"]
        assert {r["request_id"] for r in rows} == set(ids)
        # The token budget's use in the window is read back from the usage table.
        with pytest.raises(openai.RateLimitError):
            complete(s2, bkey, **body)
    finally:
        s2.stop()


def test_keys_never_in_clear(tsrv):
    """Runs last: every key handed out above is absent from the database files and server logs."""
    assert len(ALL_KEYS) > 10
    blobs = {p.name: p.read_bytes() for p in DB_DIR.glob("tenancy.db*")}
    assert "tenancy.db" in blobs
    for p in LOG_DIR.glob("tenants*.log"):
        blobs[p.name] = p.read_bytes()
    for k in ALL_KEYS + [ADMIN_KEY]:
        secret = k.rsplit("-", 1)[-1].encode()
        for name, b in blobs.items():
            assert secret not in b, f"a key is in clear in {name}"
