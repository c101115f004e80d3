"""Load test: 200 streamed chat requests at concurrency 32 against SmolLM2 on loopback.

Asserts zero errors and that every stream completes; prints requests/s and p50/p99 time to first
token, and writes them to target/e2e-logs/load.json.
"""

import asyncio
import json
import statistics
import time

import openai

from conftest import LOG_DIR, MODEL_NAME

REQUESTS = 200
CONCURRENCY = 32
MAX_TOKENS = 16
TOPICS = ["the sea", "a cat", "Paris", "rain", "coffee", "mountains", "a robot", "the moon"]


def percentile(xs, p):
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one(client, sem, i, results):
    async with sem:
        start = time.perf_counter()
        ttft = None
        text, finish, usage = "", None, None
        try:
            stream = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": f"Write a sentence about {TOPICS[i % len(TOPICS)]} (#{i})."}],
                max_tokens=MAX_TOKENS,
                temperature=0.8,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                for c in chunk.choices:
                    if c.delta.content and ttft is None:
                        ttft = time.perf_counter() - start
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            results.append({"ok": finish in ("stop", "length") and usage is not None, "ttft": ttft, "e2e": time.perf_counter() - start, "tokens": usage.completion_tokens if usage else 0})
        except Exception as e:  # counted, reported and failed on below
            results.append({"ok": False, "error": repr(e)})


async def run_load(url):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    sem = asyncio.Semaphore(CONCURRENCY)
    results = []
    start = time.perf_counter()
    await asyncio.gather(*(one(client, sem, i, results) for i in range(REQUESTS)))
    elapsed = time.perf_counter() - start
    await client.close()
    return results, elapsed


def test_load(server, capsys):
    server.wait_idle()
    results, elapsed = asyncio.run(asyncio.wait_for(run_load(server.url), timeout=600))
    errors = [r for r in results if not r["ok"]]
    assert len(results) == REQUESTS
    ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
    report = {
        "requests": REQUESTS,
        "concurrency": CONCURRENCY,
        "max_tokens": MAX_TOKENS,
        "errors": len(errors),
        "seconds": round(elapsed, 2),
        "requests_per_s": round(REQUESTS / elapsed, 2),
        "output_tokens_per_s": round(sum(r.get("tokens", 0) for r in results) / elapsed, 1),
        "ttft_p50_s": round(percentile(ttfts, 50), 3) if ttfts else None,
        "ttft_p99_s": round(percentile(ttfts, 99), 3) if ttfts else None,
        "e2e_p50_s": round(statistics.median(r["e2e"] for r in results if "e2e" in r), 3) if ttfts else None,
    }
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / "load.json").write_text(json.dumps(report, indent=2))
    with capsys.disabled():
        print(f"\nload test: {json.dumps(report)}")
    assert not errors, errors[:5]
    assert len(ttfts) == REQUESTS
    m = server.wait_idle()
    assert m["wasmserve_num_requests_waiting"] == 0
