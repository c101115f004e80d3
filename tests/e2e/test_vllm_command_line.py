"""A Cubic seed's `vllm serve` command line run verbatim with `wasmserve serve` (device flags
aside), on the tiny Kimi K3 Cubic checkpoint (tests/reference/make_tiny_kimi_k3.py): the
positional model, vLLM's flags accepted, mapped or checked; flags or settings we cannot honour
stop the start naming themselves."""

import os
import subprocess

import httpx

from conftest import BINARY, ROOT, Server

MODEL = ROOT / "tests" / "reference" / "kimi_k3" / "cubic"

SEED_FLAGS = [
    "--tensor-parallel-size", "1", "--enable-expert-parallel", "--enforce-eager", "--trust-remote-code",
    "--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi_k3", "--enable-auto-tool-choice",
    "--served-model-name", "Kimi-K3", "--quantization", "cubic", "--kv-cache-dtype", "fp8_q16",
    "--gpu-memory-utilization", "0.1", "--mm-encoder-tp-mode", "data", "--max-model-len", "64",
    "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--enable-prefix-caching",
    "--host", "127.0.0.1", "--disable-uvicorn-access-log",
]


def vllm_server(name, flags, env=None):
    s = Server(name, env=env)
    # `wasmserve serve MODEL <vLLM flags> --port 0` (the fixture's --model and cache size dropped).
    s.args = [str(BINARY), "serve", str(MODEL), *flags, "--port", "0"]
    return s


def test_the_seed_command_line_serves():
    s = vllm_server("vllm-cli", SEED_FLAGS).start()
    try:
        log = s.log_text()
        assert "no code from the checkpoint is ever run" in log and "KV cache sized from host memory" in log, log
        r = httpx.get(s.url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in r["data"]] == ["Kimi-K3"]
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "model": "Kimi-K3", "prompt": "hello 你好", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        # --max-model-len 64: a longer prompt is refused, naming the limit.
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "model": "Kimi-K3", "prompt": list(range(3, 80)), "max_tokens": 1})
        assert r.status_code == 400 and "64" in r.text, r.text
        # K3's tokenizer form: the special token spelled in text is its id.
        r = httpx.post(s.url + "/tokenize", timeout=30, json={"prompt": "<|open|>"}).json()
        assert r["tokens"] == [303] and r["max_model_len"] == 64, r
    finally:
        s.stop()


def test_cubic_dynamic_a8_from_the_environment():
    """VLLM_CUBIC_DYNAMIC_A8=1, as the A8 seed line sets it: Cubic layers take the A8 path."""
    s = vllm_server("vllm-cli-a8", SEED_FLAGS, env={"VLLM_CUBIC_DYNAMIC_A8": "1"}).start()
    try:
        assert "dynamic-A8 mode" in s.log_text() and "cpu_activations=int8" in s.log_text(), s.log_text()
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "model": "Kimi-K3", "prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        s.stop()


def test_served_model_name_aliases():
    """`--served-model-name a b`: requests may name either; responses and the listing carry the first."""
    flags = list(SEED_FLAGS)
    flags.insert(flags.index("Kimi-K3") + 1, "kimi")
    s = vllm_server("vllm-cli-alias", flags).start()
    try:
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "model": "kimi", "prompt": "hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["model"] == "Kimi-K3", r.text
        assert [m["id"] for m in httpx.get(s.url + "/v1/models", timeout=30).json()["data"]] == ["Kimi-K3"]
        assert httpx.get(s.url + "/v1/models/kimi", timeout=30).status_code == 200
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={"model": "other", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404, r.text
    finally:
        s.stop()


def refused(flags, env=None):
    args = [str(BINARY), "serve", str(MODEL), *flags, "--port", "0"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "NO_COLOR": "1", **(env or {})})
    assert p.returncode != 0, p.stdout + p.stderr
    return p.stderr


def test_what_cannot_be_honoured_stops_the_start_by_name():
    assert "--speculative-config" in refused(["--speculative-config", "{}"])
    err = refused(["--quantization", "compressed-tensors"])
    assert "--quantization compressed-tensors" in err and "'cubic'" in err, err
    assert "--max-model-len" in refused(["--max-model-len", "10000000"])
    assert "given twice" in refused(["--model", str(ROOT / "tests" / "reference" / "kimi_k3" / "int4")])


def test_cors_is_off_by_default_and_follows_allowed_origins():
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    s = vllm_server("vllm-cli-no-cors", ["--max-model-len", "64"]).start()
    try:
        r = httpx.options(s.url + "/v1/chat/completions", headers=preflight, timeout=30)
        assert "access-control-allow-origin" not in r.headers, r.headers
    finally:
        s.stop()
    s = vllm_server("vllm-cli-cors", ["--allowed-origins", '["https://app.example"]']).start()
    try:
        r = httpx.options(s.url + "/v1/chat/completions", headers=preflight, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example", r.headers
        assert "post" in r.headers["access-control-allow-methods"].lower()
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "https://app.example"}, timeout=30)
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.options(s.url + "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}, timeout=30)
        assert "access-control-allow-origin" not in r.headers, r.headers
    finally:
        s.stop()
    assert "--allow-credentials" in refused(["--allowed-origins", "*", "--allow-credentials"])
