"""Fixtures that run the real `wasmserve serve` binary on a free loopback port.

The server binds port 0 and logs "listening on http://HOST:PORT"; we read the port from its log
file (a file rather than a pipe, so a chatty server can never block on a full pipe).
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
# cargo puts the binary under CARGO_TARGET_DIR when that is set (scripts/test-e2e builds it there).
BINARY = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target").resolve() / "release" / "wasmserve"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
LOG_DIR = ROOT / "target" / "e2e-logs"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
LISTENING = re.compile(r"listening on http://([0-9.]+):(\d+)")


class Server:
    def __init__(self, name, extra_args=(), env=None):
        self.name = name
        self.args = [str(BINARY), "serve", "--model", str(MODEL), "--port", "0", "--kv-cache-memory", "256MiB", *extra_args]
        self.env = {**os.environ, "NO_COLOR": "1", "RUST_LOG": os.environ.get("RUST_LOG", "info")}
        # A key in the caller's environment would turn auth on for every server.
        self.env.pop("WASMSERVE_API_KEY", None)
        self.env.update(env or {})
        self.proc = None
        self.url = None

    def start(self, timeout=60):
        assert BINARY.exists(), f"{BINARY} is missing: run `cargo build --release` (scripts/test-e2e does)"
        assert MODEL.exists(), f"{MODEL} is missing: run scripts/fetch-default-model"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{self.name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            m = LISTENING.search(self.log_text())
            if m:
                self.url = f"http://{m.group(1)}:{m.group(2)}"
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"server did not report its port:\n{self.log_text()}")
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server never became healthy:\n{self.log_text()}")

    def log_text(self):
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout=30):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def client(self, **kw):
        kw.setdefault("api_key", "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.url + "/v1", **kw)

    def metrics(self):
        """The unlabelled samples of /metrics as {name: float}."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout=15):
        """Waits until the engine has no running or waiting sequence and every KV block is free."""
        deadline = time.time() + timeout
        m = {}
        while time.time() < deadline:
            m = self.metrics()
            if (
                m["wasmserve_num_requests_running"] == 0
                and m["wasmserve_num_requests_waiting"] == 0
                and m["wasmserve_kv_cache_blocks_free"] == m["wasmserve_kv_cache_blocks_total"]
            ):
                return m
            time.sleep(0.05)
        raise AssertionError(f"engine did not become idle: {m}")


@pytest.fixture(scope="session")
def server():
    s = Server("main").start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def capital_messages():
    return [{"role": "user", "content": "What is the capital of France?"}]
