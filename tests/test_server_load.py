"""Cancellation, back-pressure and a small load test of the server on the CPU stand-in engine, over loopback.
Every loop is bounded in count and in time."""
import asyncio
import json
import random
import socket
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from speedcore.server.fake_engine import make_fake_llm  # noqa: E402
from speedcore.server.runner import ServerThread, make_app  # noqa: E402

MODEL = "fake"


def serve(step_delay, max_num_seqs, max_queue, max_model_len=256, engine_process=False):
    import functools

    from speedcore.server.engine_process import RemoteBackend

    factory = functools.partial(make_fake_llm, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                step_delay=step_delay)
    llm = RemoteBackend(factory, start_timeout=120) if engine_process else factory()
    return ServerThread(make_app(llm, served_model_name=MODEL, max_queue=max_queue)), llm


def wait_idle(server, timeout=10.0):
    """Until no request is in flight and every KV block is free, as the engine sees it."""
    from speedcore.server.loadgen import idle_state

    deadline = time.monotonic() + timeout
    while True:
        st = server.engine.call(idle_state).result(timeout)
        if server.engine.num_in_flight == 0 and not st[0] and st[2] == st[3] and not st[1]:
            return
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {st}, {server.engine.num_in_flight} in flight"
        time.sleep(0.02)


def open_stream(server, max_tokens=1000):  # 10 s at the slow server's 10 ms per step: outlives any check
    c = httpx.Client(timeout=30)
    r = c.send(c.build_request("POST", server.url + "/v1/completions",
                               json=dict(model=MODEL, prompt="t1", max_tokens=max_tokens, temperature=0, stream=True)),
               stream=True)
    return c, r


@pytest.fixture(scope="module")
def slow():
    s, llm = serve(step_delay=0.01, max_num_seqs=4, max_queue=2, max_model_len=1024)
    with s:
        yield s


def test_disconnect_mid_stream_frees_blocks(slow):
    aborted0 = slow.engine.metrics.requests_aborted.value()
    tokens0 = slow.engine.metrics.generation_tokens.value()
    c, r = open_stream(slow)
    lines = r.iter_lines()
    got = [next(lines) for _ in range(6)]  # 3 events and their blank lines
    assert sum(g.startswith("data: ") for g in got) == 3
    used = slow.engine.call(lambda b: b.llm.block_manager.num_blocks - b.llm.block_manager.num_free_blocks).result(5)
    assert used > 0
    r.close()
    c.close()
    wait_idle(slow)
    assert slow.engine.metrics.requests_aborted.value() == aborted0 + 1
    assert slow.engine.metrics.generation_tokens.value() - tokens0 < 200  # stopped well before its 1000 tokens


def test_disconnect_non_streaming(slow):
    aborted0 = slow.engine.metrics.requests_aborted.value()
    body = json.dumps(dict(model=MODEL, prompt="t1", max_tokens=1000, temperature=0)).encode()
    sock = socket.create_connection((slow.host, slow.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 10
    while slow.engine.stats().get("running", 0) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    wait_idle(slow)
    assert slow.engine.metrics.requests_aborted.value() == aborted0 + 1


def test_queue_full_503(slow):
    """4 run, 2 wait, the 7th is refused in OpenAI's format; cancelling all brings the engine back to idle."""
    held = [open_stream(slow) for _ in range(6)]
    assert all(r.status_code == 200 for _, r in held)
    rejected0 = slow.engine.metrics.requests_rejected.value()
    r = httpx.post(slow.url + "/v1/completions", json=dict(model=MODEL, prompt="t1", max_tokens=5), timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "server_overloaded"
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="t1", max_tokens=5)
    assert e.value.status_code == 503
    assert slow.engine.metrics.requests_rejected.value() == rejected0 + 2
    metrics = httpx.get(slow.url + "/metrics", timeout=10).text
    assert "speedcore_num_requests_running 4" in metrics and "speedcore_num_requests_waiting 2" in metrics
    for c, r in held:
        r.close()
        c.close()
    wait_idle(slow)
    ok = client.completions.create(model=MODEL, prompt="t1", max_tokens=3, temperature=0)
    assert ok.choices[0].text == " t2 t3 t4"


def test_engine_failure_fails_requests_and_serving_goes_on(slow):
    runner = slow.engine.backend.llm.runner
    real_run = runner.run

    def broken(batch, logits_all=False):
        raise RuntimeError("injected fault")

    runner.run = broken
    try:
        r = httpx.post(slow.url + "/v1/completions", json=dict(model=MODEL, prompt="t1", max_tokens=5), timeout=10)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        with httpx.stream("POST", slow.url + "/v1/completions", timeout=10,
                          json=dict(model=MODEL, prompt="t1", max_tokens=5, stream=True)) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[0])["error"]["message"]
    finally:
        runner.run = real_run
    wait_idle(slow)
    r = httpx.post(slow.url + "/v1/completions", json=dict(model=MODEL, prompt="t1", max_tokens=2, temperature=0),
                   timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t2 t3"


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine thread", "engine process"])
def test_load_concurrent_streams_with_disconnects(engine_process):
    """64 concurrent streaming clients, 300 requests of mixed lengths, every 7th disconnecting after 2 events:
    each finished stream has exactly its tokens, a usage chunk and one [DONE]; none lost or duplicated; the
    engine is idle and every KV block free afterwards (the engine on a thread, or in its own process)."""
    n_req, conc = 300, 64
    rng = random.Random(0)
    jobs = [dict(i=i, start=rng.randrange(0, 800), n=rng.randrange(4, 40), drop=(i % 7 == 3)) for i in range(n_req)]
    s, llm = serve(step_delay=0.001, max_num_seqs=32, max_queue=64, engine_process=engine_process)
    results = {}

    async def one(client, job):
        body = dict(model=MODEL, prompt=f"t{job['start']}", max_tokens=job["n"], temperature=0, stream=True,
                    stream_options=dict(include_usage=True), user=str(job["i"]))
        events = []
        async with client.stream("POST", s.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if job["drop"] and len(events) == 2:
                        break
        results.setdefault(job["i"], []).append(events)

    async def main():
        sem = asyncio.Semaphore(conc)
        limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            async def guarded(job):
                async with sem:
                    await one(client, job)
            await asyncio.wait_for(asyncio.gather(*(guarded(j) for j in jobs)), 90)

    t0 = time.monotonic()
    with s:
        asyncio.run(main())
        wait_idle(s)
        m = s.engine.metrics
        assert m.requests_aborted.value() + m.requests_finished.value(finished_reason="length") == n_req
        assert m.requests_rejected.value() == 0
    llm.close()  # the engine process, if any
    assert sorted(results) == list(range(n_req)) and all(len(v) == 1 for v in results.values())
    completed = 0
    for job in jobs:
        ev, = results[job["i"]]
        if job["drop"]:
            assert len(ev) == 2
            continue
        completed += 1
        assert ev[-1] == "[DONE]" and ev.count("[DONE]") == 1
        objs = [json.loads(e) for e in ev[:-1]]
        usage = objs[-1]["usage"]
        assert objs[-1]["choices"] == [] and usage["completion_tokens"] == job["n"]
        text = "".join(o["choices"][0]["text"] for o in objs[:-1])
        assert text == "".join(f" t{t}" for t in range(job["start"] + 1, job["start"] + 1 + job["n"]))
        assert objs[-2]["choices"][0]["finish_reason"] == "length"
        assert len({o["id"] for o in objs}) == 1
    assert completed == n_req - sum(j["drop"] for j in jobs)
    assert time.monotonic() - t0 < 120
