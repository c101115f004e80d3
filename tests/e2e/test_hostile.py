"""Hostile load against the real server (issue: bounded memory per request, no budget bypass, no
head-of-line stalls). Each test reproduces one hole an attack run found and checks it holds now:

- bodies under the size cap but far over the context: refused before tokenizing, quickly, with
  the server's peak RSS within the documented bound (docs/hardening.md);
- a client that hangs up mid-stream is charged the tokens it was sent, and the budget stops it;
- a short request's time to first token while a long prompt prefills;
- /health and another tenant's chat stay fast while request-policy plugins loop to their deadline;
- slowloris headers, idle connections and a dripped body are closed at their timeouts; the
  per-client connection cap closes extra sockets at once.

Figures go to target/e2e-logs/hostile.json.
"""

import json
import os
import socket
import statistics
import subprocess
import threading
import time

import httpx
import openai
import pytest

from conftest import BINARY, LOG_DIR, MODEL_NAME, ROOT, Server, capital_messages

PLUGINS = ROOT / "target" / "plugins"
ADMIN_KEY = "hostile-admin-" + os.urandom(8).hex()
DIR = LOG_DIR / "hostile"
DB = DIR / "tenancy.db"
FIGURES = {}


def record(name, value):
    FIGURES[name] = value
    DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / "hostile.json").write_text(json.dumps(FIGURES, indent=2))


def cli(*args):
    p = subprocess.run([str(BINARY), *args, "--db", str(DB)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def hsrv():
    DIR.mkdir(parents=True, exist_ok=True)
    for f in DIR.glob("tenancy.db*"):
        f.unlink()
    cli("tenants", "create", "budgeted", "--token-budget", "600", "--budget-window", "86400")
    cli("tenants", "create", "other")
    cli("tenants", "create", "looping")
    s = Server("hostile", [
        "--db", str(DB),
        "--header-read-timeout", "2", "--body-read-timeout", "2",
        "--max-connections-per-client", "96",
    ], env={"WASMSERVE_ADMIN_KEY": ADMIN_KEY}).start()
    s.keys = {t: cli("keys", "create", "--tenant", t)["key"] for t in ("budgeted", "other", "looping")}
    yield s
    s.stop()


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def health_ms(srv):
    t = time.perf_counter()
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    return (time.perf_counter() - t) * 1e3


def test_large_bodies_are_refused_before_tokenizing_with_bounded_memory(hsrv):
    key = hsrv.keys["other"]
    # 7.8 MB of ordinary text (under the 8 MiB body cap), far over SmolLM2's 8192-token context.
    text = ("The quick brown fox jumps over the lazy dog. " * 180_000)[:7_800_000]
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 4})
    before = rss_kib(hsrv.proc.pid)
    peak = [before]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kib(hsrv.proc.pid))
            time.sleep(0.005)

    w = threading.Thread(target=watch)
    w.start()
    results = []

    def send():
        t = time.perf_counter()
        r = httpx.post(hsrv.url + "/v1/chat/completions", content=body, timeout=120,
                       headers={"Authorization": f"Bearer {key}", "content-type": "application/json"})
        results.append((r.status_code, r.json()["error"]["code"], time.perf_counter() - t))

    n = 6
    threads = [threading.Thread(target=send) for _ in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    during = health_ms(hsrv)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(0.5)  # the trim after large bodies runs 100 ms after the last one ends
    stop.set()
    w.join()
    assert all(r[:2] == (400, "context_length_exceeded") for r in results), results
    grown_mb = (peak[0] - before) / 1024
    after_mb = (rss_kib(hsrv.proc.pid) - before) / 1024
    record("large_bodies", {"requests": n, "body_mb": len(body) / 1e6, "wall_s": round(wall, 2),
                            "slowest_s": round(max(r[2] for r in results), 2), "peak_rss_growth_mb": round(grown_mb, 1),
                            "rss_growth_after_mb": round(after_mb, 1), "health_ms_during": round(during, 1)})
    # docs/hardening.md: at most ~10 bytes of memory per body byte per request in flight (raw
    # body, parsed JSON, the template engine's copy and its output), and no tokenizing (before,
    # one such body took 1.2 GB); freed memory goes back to the system afterwards.
    assert grown_mb < n * 10 * len(body) / 2**20, FIGURES["large_bodies"]
    assert after_mb < 100, FIGURES["large_bodies"]
    assert max(r[2] for r in results) < 30, results


def test_a_client_that_hangs_up_is_charged_and_the_budget_stops_it(hsrv):
    key = hsrv.keys["budgeted"]
    c = hsrv.client(api_key=key)
    received = 0
    refused_after = None
    for i in range(20):
        try:
            stream = c.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=100, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
        except openai.RateLimitError as e:
            refused_after = i
            assert "budget" in e.body["message"], e.body
            break
        for n, _chunk in enumerate(stream):
            received += 1
            if n == 30:
                break
        stream.close()  # hang up mid-stream
        time.sleep(0.3)
    assert refused_after is not None, f"20 hung-up streams of 100 tokens each were never stopped by a 600-token budget ({received} tokens received)"
    # The rows of the hung-up streams carry what they were sent.
    deadline = time.time() + 10
    while True:
        rows = httpx.get(hsrv.url + "/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()["data"]
        if len(rows) >= refused_after or time.time() > deadline:
            break
        time.sleep(0.2)
    aborted = [r for r in rows if r["status"] == "aborted"]
    assert aborted and all(r["completion_tokens"] >= 30 and r["prompt_tokens"] > 0 for r in aborted), rows
    charged = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    record("hang_up", {"streams_before_refusal": refused_after, "tokens_received": received, "tokens_charged": charged})
    # Admission reserves prompt + max_tokens, so nothing passes the budget by more than nothing.
    assert charged <= 600, rows


def ttft(c, **kw):
    """Seconds to the first generated text (the role chunk that opens a chat stream is not it)."""
    t = time.perf_counter()
    for chunk in c.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=2, temperature=0,
                                           stream=True, **kw):
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            break
    return time.perf_counter() - t


def test_a_short_request_is_not_stalled_by_a_long_prefill(hsrv):
    c = hsrv.client(api_key=hsrv.keys["other"])
    idle = statistics.median(ttft(c) for _ in range(5))
    # ~2,000 tokens of prompt: many engine steps of prefill (about 20 s on 2 cores).
    long_prompt = " ".join(f"word{i}" for i in range(650))
    done = {}

    def long_request():
        t = time.perf_counter()
        c.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=1)
        done["s"] = time.perf_counter() - t

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.3)
    during = []
    while t.is_alive() and len(during) < 5:
        during.append(ttft(c))
    t.join()
    record("prefill_fairness", {"idle_ttft_s": round(idle, 3), "during_ttft_s": [round(x, 3) for x in during],
                                "long_prefill_s": round(done["s"], 2)})
    assert during, "the long prompt finished before a short request could be measured"
    # Bound (docs/hardening.md): a newcomer waits for the step in flight and one step in which the
    # long prompt's chunk is capped (half the step budget), never for the rest of the prefill,
    # which is what it waited for before (the whole ~20 s for the first one).
    assert during[0] < done["s"] / 4 and max(during) < done["s"] / 3, FIGURES["prefill_fairness"]


def test_health_and_other_requests_stay_fast_while_policies_loop(hsrv):
    if not (PLUGINS / "hostile-policy.wasm").exists():
        pytest.skip("plugins not built")
    spec = {"name": "looper", "kind": "request-policy", "tenants": ["looping"], "limits": {"call_timeout_ms": 2000}}
    h = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(hsrv.url + "/admin/plugins", content=(PLUGINS / "hostile-policy.wasm").read_bytes(),
                   headers={**h, "x-plugin-spec": json.dumps(spec)}, timeout=120)
    assert r.status_code == 201, r.text
    # Server maxima: a deadline of 2^63 ms or 100,000 instances are refused, naming the field.
    for bad in ({"call_timeout_ms": 2**63}, {"max_instances": 100_000}):
        r = httpx.post(hsrv.url + "/admin/plugins", content=(PLUGINS / "hostile-policy.wasm").read_bytes(),
                       headers={**h, "x-plugin-spec": json.dumps({**spec, "name": "bad", "limits": bad})}, timeout=120)
        assert r.status_code == 400 and next(iter(bad)) in r.text, r.text
    try:
        looping = hsrv.client(api_key=hsrv.keys["looping"], max_retries=0)
        other = hsrv.client(api_key=hsrv.keys["other"])
        errors = []

        def loop_call():
            try:
                looping.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, stop=["LOOP"])
            except openai.APIStatusError as e:
                errors.append(e.status_code)

        threads = [threading.Thread(target=loop_call) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        health = [health_ms(hsrv) for _ in range(10)]
        t = time.perf_counter()
        other.chat.completions.create(model=MODEL_NAME, messages=capital_messages(), max_tokens=4)
        other_s = time.perf_counter() - t
        for t in threads:
            t.join()
        record("looping_plugins", {"health_ms_max": round(max(health), 1), "other_tenant_chat_s": round(other_s, 2),
                                   "loop_statuses": sorted(errors)})
        assert max(health) < 100, health
        assert other_s < 1.5, other_s
        # The looping tenant's requests fail on its own policy's deadline, and only those.
        assert errors == [504] * 8, errors
    finally:
        httpx.delete(hsrv.url + "/admin/plugins/looper", headers=h, timeout=30)


def open_socket(srv):
    host, port = srv.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_within(sock, seconds):
    """Whether the server closes `sock` within `seconds` (reads EOF or a reset)."""
    sock.settimeout(seconds)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_slow_and_idle_sockets_are_closed_and_extra_connections_refused(hsrv):
    # 16 slowloris clients (a header byte every 0.5 s) and 32 idle sockets: all closed by the
    # 2 s header-read timeout.
    slow = [open_socket(hsrv) for _ in range(16)]
    idle = [open_socket(hsrv) for _ in range(32)]
    t0 = time.perf_counter()
    for i in range(4):
        for s in slow:
            try:
                s.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "[i * 10:(i + 1) * 10] or b"a")
            except OSError:
                pass
        time.sleep(0.5)
    assert all(closed_within(s, 6) for s in slow + idle)
    closed_s = time.perf_counter() - t0
    # A body dripped a byte at a time: 408 at the 2 s body-read timeout.
    s = open_socket(hsrv)
    auth = f"Authorization: Bearer {hsrv.keys['other']}\r\n".encode()
    s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    t = time.perf_counter()
    for ch in b'{"prompt": "':
        try:
            s.send(bytes([ch]))
        except OSError:
            break  # answered and closed at the timeout
        time.sleep(0.2)
    s.settimeout(10)
    head = s.recv(4096).decode(errors="replace")
    dripped_s = time.perf_counter() - t
    assert head.startswith("HTTP/1.1 408"), head
    # The per-client cap (96 here): sockets beyond it are closed at once.
    many = [open_socket(hsrv) for _ in range(110)]
    time.sleep(0.3)
    refused = sum(closed_within(x, 0.2) for x in many[96:])
    for x in many:
        x.close()
    metrics = httpx.get(hsrv.url + "/metrics", timeout=10).text
    record("sockets", {"slow_and_idle_closed_s": round(closed_s, 2), "dripped_body_408_s": round(dripped_s, 2),
                       "refused_over_cap": refused})
    # (A connection or two of the earlier tests may still be open.)
    assert 14 <= refused <= 16, refused
    assert "wasmserve_connections_refused_total" in metrics and "wasmserve_body_read_timeouts_total 1" in metrics
    # The server still serves.
    assert health_ms(hsrv) < 1000
