"""`serve --expert-parallel-size` (README names it): the tiny Kimi-Linear checkpoint served with its
routed experts over two simulated ranks answers greedy completions token for token as the
unsharded server does (the CPU kernels are batch- and shard-invariant)."""

import httpx

from conftest import ROOT, Server

MODEL = ROOT / "tests" / "reference" / "kimi_linear" / "model"


def greedy_ids(srv, prompt):
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_expert_parallel_serve_matches_the_whole_model():
    prompts = [[1, 2, 3, 4], [17, 5, 99, 100, 250, 3]]
    got = {}
    for name, extra in (("whole", []), ("ep2", ["--expert-parallel-size", "2"])):
        s = Server(f"sharding-{name}", extra)
        s.args[s.args.index("--model") + 1] = str(MODEL)
        s.start()
        try:
            got[name] = [greedy_ids(s, p) for p in prompts]
            if name == "ep2":
                assert '"ep"' in s.log_text() or "sharding=\"ep\"" in s.log_text()
        finally:
            s.stop()
    assert got["ep2"] == got["whole"], got
