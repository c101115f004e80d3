"""A client that hangs up, or stops reading a stream, frees its request in the engine (checked
through /metrics)."""

import json
import socket
import time

import httpx

from conftest import MODEL_NAME, Server


def long_chat(**kw):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000, "ignore_eos": True, **kw}


def raw_post(server, body, rcvbuf=None):
    """Sends a chat request on a bare socket and returns the socket unread."""
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def wait_running(server, n, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.metrics()["wasmserve_num_requests_running"] == n:
            return
        time.sleep(0.02)
    raise AssertionError(f"never saw {n} running sequences")


def test_stream_disconnect_frees_the_request(server):
    server.wait_idle()
    aborted = server.metrics().get('wasmserve_request_finished_total{outcome="abort"}', 0)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=long_chat(stream=True, n=2)) as r:
            lines = r.iter_lines()
            got = [line for _, line in zip(range(8), lines)]
            assert any('"content"' in line for line in got)
            m = server.metrics()
            assert m["wasmserve_num_requests_running"] == 2
            assert m["wasmserve_kv_cache_blocks_free"] < m["wasmserve_kv_cache_blocks_total"]
    started = time.time()
    m = server.wait_idle(timeout=10)
    # Well before 3000 tokens could have been generated.
    assert time.time() - started < 5
    assert m['wasmserve_request_finished_total{outcome="abort"}'] == aborted + 1


def test_non_stream_disconnect_frees_the_request(server):
    server.wait_idle()
    s = raw_post(server, long_chat())
    wait_running(server, 1)
    s.close()
    server.wait_idle(timeout=10)


def test_a_stream_the_client_stops_reading_is_aborted():
    """A client that keeps the connection open but never reads would hold its plugin sessions and
    concurrency slot for the whole generation; --stream-stall-timeout cuts it off."""
    srv = Server("stall", ["--stream-stall-timeout", "1"]).start()
    try:
        # Big chunks (8 choices with 20 top logprobs each) and a tiny receive window fill the
        # socket buffers quickly; the body is a 3000-token stream the client never reads.
        s = raw_post(srv, long_chat(stream=True, n=8, logprobs=True, top_logprobs=20), rcvbuf=4096)
        wait_running(srv, 8)
        deadline = time.time() + 90
        while srv.metrics()["wasmserve_stream_stalled_total"] < 1:
            assert time.time() < deadline, "the stalled stream was never aborted"
            time.sleep(0.2)
        # Freed while the connection is still open, long before 3000 tokens.
        m = srv.wait_idle(timeout=10)
        assert m['wasmserve_request_finished_total{outcome="abort"}'] == 1
        assert "client stopped reading" in srv.log_text()
        s.close()
        # The server goes on serving (greedy: a sampled reply may end within 3 tokens).
        r = srv.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason == "length"
    finally:
        srv.stop()


def test_server_still_serves_after_disconnects(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris."
