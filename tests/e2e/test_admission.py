"""One admission path for every generation endpoint (server/admission.rs): each shipped request
policy holds on /v1/completions exactly as on /v1/chat/completions, streamed or not, and a policy
a tenant or key is bound to (`--request-policy`, stored in the tenancy database) applies to that
caller's requests even when the deployment's own tenant list does not name it; a binding to a
policy that is not deployed refuses the request (503) instead of letting it through unchecked.
"""

import json
import os

import httpx
import openai
import pytest

import subprocess

from conftest import BINARY, LOG_DIR, MODEL_NAME, ROOT, Server, capital_messages

PLUGINS = ROOT / "target" / "plugins"
ADMIN_KEY = "admission-admin-" + os.urandom(8).hex()
DB_DIR = LOG_DIR / "admission"
DB = DB_DIR / "tenancy.db"

pytestmark = pytest.mark.skipif(not (PLUGINS / "policy-max-tokens-cap.wasm").exists() and os.environ.get("WASMSERVE_REQUIRE_PLUGINS") != "1",
                                reason="plugins not built (scripts/build-plugins)")


def cli(*args):
    p = subprocess.run([str(BINARY), *args, "--db", str(DB)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def asrv():
    DB_DIR.mkdir(parents=True, exist_ok=True)
    for f in DB_DIR.glob("tenancy.db*"):
        f.unlink()
    # Deployed for no tenant by its own list: only a binding brings it to a caller.
    cfg = DB_DIR / "plugins.json"
    cfg.write_text(json.dumps({"plugins": [
        {"name": "bound-cap", "kind": "request-policy", "component": str(PLUGINS / "policy-max-tokens-cap.wasm"),
         "tenants": ["nobody"], "config": {"max_tokens": 3}},
    ]}))
    cli("tenants", "create", "plain")
    cli("tenants", "create", "capped", "--request-policy", "bound-cap")
    cli("tenants", "create", "dangling", "--request-policy", "not-deployed")
    keys = {t: cli("keys", "create", "--tenant", t)["key"] for t in ("plain", "capped", "dangling")}
    # A key's own binding wins over its tenant's.
    keys["plain-key-bound"] = cli("keys", "create", "--tenant", "plain", "--request-policy", "bound-cap")["key"]
    s = Server("admission", ["--db", str(DB), "--plugins", str(cfg)], env={"WASMSERVE_ADMIN_KEY": ADMIN_KEY}).start()
    s.keys = keys
    yield s
    s.stop()


def upload(srv, name, component, config):
    spec = {"name": name, "kind": "request-policy", "config": config}
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120) as a:
        r = a.post("/admin/plugins", content=(PLUGINS / f"{component}.wasm").read_bytes(), headers={"x-plugin-spec": json.dumps(spec)})
        assert r.status_code == 201, r.text


def remove(srv, name):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as a:
        a.delete(f"/admin/plugins/{name}")


def chat(c, stream=False, max_tokens=40):
    kw = dict(model=MODEL_NAME, messages=capital_messages(), max_tokens=max_tokens, temperature=0)
    if stream:
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        return chunks[-1].usage.completion_tokens
    return c.chat.completions.create(**kw).usage.completion_tokens


def complete(c, stream=False, max_tokens=40):
    kw = dict(model=MODEL_NAME, prompt="The capital of France is a city that", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        return chunks[-1].usage.completion_tokens
    return c.completions.create(**kw).usage.completion_tokens


ENDPOINTS = [("chat", chat), ("completions", complete)]


@pytest.mark.parametrize("stream", [False, True])
def test_every_policy_holds_on_every_generation_endpoint(asrv, stream):
    c = asrv.client(api_key=asrv.keys["plain"])
    try:
        upload(asrv, "a-cap", "policy-max-tokens-cap", {"max_tokens": 5})
        for name, call in ENDPOINTS:
            assert call(c, stream) == 5, name
        remove(asrv, "a-cap")
        upload(asrv, "b-len", "policy-prompt-length-limit", {"max_prompt_tokens": 4})
        for name, call in ENDPOINTS:
            with pytest.raises(openai.BadRequestError) as e:
                call(c, stream)
            assert e.value.body["code"] == "policy_rejected" and "b-len" in e.value.body["message"], name
        remove(asrv, "b-len")
        upload(asrv, "c-allow", "policy-model-allow-list", {"models": ["some-other-model"]})
        for name, call in ENDPOINTS:
            with pytest.raises(openai.PermissionDeniedError) as e:
                call(c, stream)
            assert e.value.body["code"] == "policy_rejected" and "c-allow" in e.value.body["message"], name
    finally:
        for n in ("a-cap", "b-len", "c-allow"):
            remove(asrv, n)
    # Nothing left over: the endpoints answer in full again.
    for name, call in ENDPOINTS:
        assert call(c, stream) > 5, name


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_policy_binding_applies_to_its_caller_only(asrv, stream):
    for key in ("capped", "plain-key-bound"):
        c = asrv.client(api_key=asrv.keys[key])
        for name, call in ENDPOINTS:
            assert call(c, stream) == 3, (key, name)
    # The deployment names no tenant: callers without the binding are not capped.
    plain = asrv.client(api_key=asrv.keys["plain"])
    for name, call in ENDPOINTS:
        assert call(plain, stream) > 3, name


def test_a_binding_to_a_missing_policy_fails_closed(asrv):
    c = asrv.client(api_key=asrv.keys["dangling"], max_retries=0)
    for name, call in ENDPOINTS:
        with pytest.raises(openai.APIStatusError) as e:
            call(c)
        assert e.value.status_code == 503 and e.value.body["code"] == "policy_unavailable", name
        assert "not-deployed" in e.value.body["message"]
