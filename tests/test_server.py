"""The OpenAI-compatible server over real loopback sockets, with the openai client, on the CPU stand-in engine
(speedcore/server/fake_engine.py: the engine's own scheduler and request loop over a counting model, where
"t5 t6" continues " t7 t8 t9 ...").  Protocol, parameters, errors, auth, metrics."""
import json

import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from speedcore.server.fake_engine import make_fake_llm  # noqa: E402
from speedcore.server.runner import ServerThread, make_app  # noqa: E402

KEY = "test-key-123"
MODEL = "fake-model"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module", params=["engine thread", "engine process"])
def server(request):
    """Every test below twice: the engine on a thread of the server's process, and in a process of its own
    (speedcore/server/engine_process.py)."""
    import functools

    from speedcore.server.engine_process import RemoteBackend

    factory = functools.partial(make_fake_llm, max_model_len=128, max_num_seqs=8)
    llm = factory() if request.param == "engine thread" else RemoteBackend(factory, start_timeout=120)
    app = make_app(llm, served_model_name=MODEL, api_key=KEY, max_queue=16, max_request_bytes=64 << 10,
                   max_prompt_chars=8000)
    try:
        with ServerThread(app) as s:
            yield s
    finally:
        llm.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def words(start, n):
    return "".join(f" t{i}" for i in range(start, start + n))


def post(server, path, body, headers=AUTH, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json", **headers},
                      timeout=30, **kw)


def sse_events(server, path, body):
    """The raw data: lines of a streamed response."""
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}  # no key needed


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="t5 t6", max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.text == words(7, 4) and c.finish_reason == "length" and c.index == 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 4, 7)  # BOS t5 t6
    # token-id prompts, a batch of one, token ids back (vLLM's return_token_ids)
    r = client.completions.create(model=MODEL, prompt=[[40, 41]], max_tokens=3, temperature=0,
                                  extra_body=dict(return_token_ids=True))
    assert r.choices[0].text == words(42, 3) and r.usage.prompt_tokens == 2
    assert r.choices[0].model_extra["token_ids"] == [42, 43, 44]


def test_completion_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="t10", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == words(11, 6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == 2
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_ends_with_done(server):
    ev = sse_events(server, "/v1/completions", dict(model=MODEL, prompt="t1", max_tokens=3, temperature=0,
                                                    stream=True))
    assert ev[-1] == "[DONE]" and ev.count("[DONE]") == 1
    objs = [json.loads(e) for e in ev[:-1]]
    assert "".join(o["choices"][0]["text"] for o in objs) == words(2, 3)
    assert all("usage" not in o for o in objs)  # no include_usage: no usage field at all
    ev = sse_events(server, "/v1/chat/completions", dict(model=MODEL, messages=[dict(role="user", content="hi")],
                                                         max_tokens=2, temperature=0, stream=True,
                                                         stream_options=dict(include_usage=True)))
    assert ev[-1] == "[DONE]"
    objs = [json.loads(e) for e in ev[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 2


def test_chat(client):
    msgs = [dict(role="system", content="be brief"), dict(role="user", content=[dict(type="text", text="hi")])]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == words(1, 5)
    # <s> <|system|> be brief <|user|> hi <|assistant|>
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == words(1, 5)
    assert chunks[-1].choices[0].finish_reason == "length"
    # no max_tokens: the rest of the context; the counting model stops at its EOS after t993 -- not reached in
    # 128 - 7 tokens, so it ends at the context
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0)
    assert r.usage.completion_tokens == 128 - 7 and r.choices[0].finish_reason == "length"


def test_stop_eos_and_min_tokens(client):
    r = client.completions.create(model=MODEL, prompt="t5", max_tokens=10, temperature=0, stop=["t9", "zzz"])
    assert r.choices[0].text == " t6 t7 t8 " and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "t9"
    chunks = list(client.completions.create(model=MODEL, prompt="t5", max_tokens=10, temperature=0, stop="t9",
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " t6 t7 t8 "
    r = client.completions.create(model=MODEL, prompt="t990", max_tokens=10, temperature=0)  # EOS after t993
    assert r.choices[0].text == words(991, 3) and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 4  # the EOS counts
    r = client.completions.create(model=MODEL, prompt="t990", max_tokens=10, temperature=0,
                                  extra_body=dict(ignore_eos=True, skip_special_tokens=False))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="t5", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["t6", "t7", "t8"] and len(lp.token_logprobs) == 3
    assert all(v < 0 for v in lp.token_logprobs)
    assert list(lp.top_logprobs[0]) == ["t6", "t7"] and lp.top_logprobs[0]["t6"] > lp.top_logprobs[0]["t7"]
    assert lp.text_offset == [0, 2, 4]
    r = client.chat.completions.create(model=MODEL, messages=[dict(role="user", content="x")], max_tokens=2,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["t1", "t2"] and len(content[0].top_logprobs) == 3
    assert content[0].bytes == list(b"t1")
    chunks = list(client.chat.completions.create(model=MODEL, messages=[dict(role="user", content="x")],
                                                 max_tokens=3, temperature=0, logprobs=True, stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == ["t1", "t2", "t3"]


def test_seeded_sampling(client):
    def run(seed):
        return client.completions.create(model=MODEL, prompt="t100", max_tokens=24, temperature=2.0, seed=seed,
                                         extra_body=dict(top_k=2)).choices[0].text

    a = run(7)
    assert run(7) == a  # the same seed, the same tokens
    assert any(run(s) != a for s in (8, 9, 10))


BAD = [
    # (path, body (bytes: raw), status, param, code)
    ("/v1/completions", b"{", 400, None, "invalid_json"),
    ("/v1/completions", b"", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", b'{"prompt": "t1", "temperature": NaN}', 400, None, "invalid_json"),
    ("/v1/completions", b'{"prompt": "t1 \xff\xfe"}', 400, None, "invalid_utf8"),
    ("/v1/completions", b'{"prompt": "t1 \\ud800"}', 400, "prompt", None),
    ("/v1/completions", dict(prompt="t1", max_tokens="10"), 400, "max_tokens", None),
    ("/v1/completions", dict(prompt="t1", max_tokens=0), 400, "max_tokens", None),
    ("/v1/completions", dict(prompt="t1", temperature=-1), 400, "temperature", None),
    ("/v1/completions", dict(prompt="t1", top_p=0), 400, "top_p", None),
    ("/v1/completions", dict(prompt="t1", top_k=-5), 400, "top_k", None),
    ("/v1/completions", dict(prompt="t1", stream="yes"), 400, "stream", None),
    ("/v1/completions", dict(prompt="t1", stop=[1]), 400, "stop", None),
    ("/v1/completions", dict(prompt="t1", stream_options=dict(include_usage=True)), 400, "stream_options", None),
    ("/v1/completions", dict(prompt="t1", n=2), 400, "n", None),
    ("/v1/completions", dict(prompt="t1", echo=True), 400, "echo", None),
    ("/v1/completions", dict(prompt="t1", logprobs=21), 400, "logprobs", None),
    ("/v1/completions", dict(prompt="t1", presence_penalty=0.5), 400, "presence_penalty", None),
    ("/v1/completions", dict(prompt=["t1", "t2"]), 400, "prompt", None),
    ("/v1/completions", dict(prompt=[]), 400, "prompt", None),
    ("/v1/completions", dict(prompt=[1, 5000]), 400, "prompt", None),
    ("/v1/completions", dict(prompt=12), 400, "prompt", None),
    ("/v1/completions", dict(max_tokens=3), 400, "prompt", None),
    ("/v1/completions", dict(prompt="t1", max_tokens=200), 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", dict(prompt=" ".join(["t1"] * 130)), 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", dict(prompt="x" * 9000), 413, "prompt", "prompt_too_large"),
    ("/v1/completions", dict(model="gpt-4", prompt="t1"), 404, "model", "model_not_found"),
    ("/v1/completions", dict(model=3, prompt="t1"), 400, "model", None),
    ("/v1/chat/completions", dict(messages="hi"), 400, "messages", None),
    ("/v1/chat/completions", dict(messages=[]), 400, "messages", None),
    ("/v1/chat/completions", dict(messages=[dict(role="wizard", content="x")]), 400, "messages[0].role", None),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content=5)]), 400, "messages[0].content", None),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content=[dict(type="image_url")])]), 400,
     "messages[0].content", None),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content="x")], top_logprobs=2), 400, "top_logprobs",
     None),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content="x")], max_completion_tokens=500), 400,
     "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content="x")], tools=[dict(type="function")]), 400,
     "tools", None),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD)
def test_bad_input(server, path, body, status, param, code):
    if isinstance(body, dict):
        body = {"model": MODEL, **body} if "model" not in body else body
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code
    assert err["type"] == "invalid_request_error"


def test_bad_input_then_good(server, client):
    """The openai client sees the errors as its exception types; the server keeps serving."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="t1", max_tokens=-1)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[dict(role="user", content="x")])
    for size in (65 << 10, 640 << 10):  # just past the limit (64 KiB), and 10x (read on and dropped)
        r = post(server, "/v1/completions", b"x" * size)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/v1/nothing", headers=AUTH, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/completions", headers=AUTH, timeout=10)
    assert r.status_code == 405 and "error" in r.json()
    assert client.completions.create(model=MODEL, prompt="t3", max_tokens=2, temperature=0).choices[0].text == \
        words(4, 2)


def test_auth(server):
    body = dict(model=MODEL, prompt="t1", max_tokens=1)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        r = post(server, "/v1/completions", body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    bad_client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()
    assert post(server, "/v1/completions", body).status_code == 200


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="t1 t2", max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            values[name] = float(v)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert "speedcore_" + name in values, name
    assert values["speedcore_generation_tokens_total"] >= 5 and values["speedcore_prompt_tokens_total"] >= 3
    assert values["speedcore_num_requests_running"] == 0 and values["speedcore_kv_cache_usage_perc"] == 0
    assert values['speedcore_time_to_first_token_seconds_bucket{le="+Inf"}'] >= 1
    assert values["speedcore_inter_token_latency_seconds_count"] >= 4
    assert values['speedcore_request_success_total{finished_reason="length"}'] >= 1
    assert values['speedcore_http_responses_total{code="200"}'] >= 1
    assert "# TYPE speedcore_time_to_first_token_seconds histogram" in text


def test_cli_builds_the_fake_engine_and_tokenizer_for_presets():
    import argparse

    from speedcore.server import cli
    from speedcore.server.fake_engine import NumberTokenizer, attach_number_tokenizer

    p = argparse.ArgumentParser()
    handlers = cli.add_parser(p.add_subparsers(dest="cmd"))
    assert set(handlers) == {"serve"}
    args = p.parse_args(["serve", "--fake-engine", "--max-model-len", "64", "--max-num-seqs", "3"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.enable_prefix_caching and args.engine_process
    assert p.parse_args(["serve", "--fake-engine", "--no-engine-process"]).engine_process is False
    llm, name = cli.build_llm(args)
    assert name == "fake" and llm.max_model_len == 64 and llm.scheduler.max_num_seqs == 3
    assert p.parse_args(["serve", "--preset", "tiny", "--no-prefix-caching"]).enable_prefix_caching is False
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--model", "x", "--preset", "tiny"])  # one source only
    assert cli._is_loopback("127.0.0.1") and cli._is_loopback("::1") and not cli._is_loopback("0.0.0.0")

    class Preset:  # what attach_number_tokenizer reads of an LLM
        config = type("C", (), dict(vocab_size=1024, bos_token_id=None, eos_token_ids=[]))()
        tokenizer = None

    tok = attach_number_tokenizer(Preset)
    assert isinstance(Preset.tokenizer, NumberTokenizer)
    assert tok.encode("t5 t1023", add_special_tokens=False) == [5, 1023]
    assert tok.decode([5, 7, tok.eos_token_id]) == "t5 t7" and tok.decode([tok.eos_token_id], False) == "</s>"


def test_chat_with_a_hugging_face_tokenizer_and_jinja_template(tmp_path):
    """The engine's own Tokenizer (tokenizer.json + a jinja chat template) behind the server: the template's
    output is what the model sees, and a template that raises is a 400 naming messages."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import AddedToken, models, pre_tokenizers

    from speedcore.engine.tokenizer import Tokenizer

    V = 1000  # the ids of NumberTokenizer(1000), which the counting model follows
    names = ["<|tool|>", "<|assistant|>", "<|user|>", "<|system|>", "</s>", "<s>"]
    vocab = {f"t{i}": i for i in range(V - 6)}
    vocab.update({n: V - 6 + k for k, n in enumerate(names)})
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(n, special=True) for n in names])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('roles must alternate user/assistant/user/...') }}{% endif %}"
                " <|{{ m['role'] }}|> {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} <|assistant|>"
                "{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(chat_template=template, bos_token="<s>",
                                                                     eos_token="</s>")))
    llm = make_fake_llm(vocab_size=V, max_model_len=64, max_num_seqs=4)
    llm.tokenizer = Tokenizer(str(tmp_path))
    with ServerThread(make_app(llm, served_model_name=MODEL)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)
        r = c.chat.completions.create(model=MODEL, messages=[dict(role="user", content="t40 t41")], max_tokens=3,
                                      temperature=0, extra_body=dict(return_token_ids=True))
        assert r.choices[0].message.content == " t1 t2 t3" and r.usage.prompt_tokens == 5  # <s> <|user|> t40 t41 <|a|>
        assert r.prompt_token_ids == [V - 1, V - 4, 40, 41, V - 5]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[dict(role="assistant", content="x")], max_tokens=3)
        assert "roles must alternate" in str(e.value) and e.value.body["param"] == "messages"
        r = c.completions.create(model=MODEL, prompt="t7 t8", max_tokens=2, temperature=0)
        assert r.choices[0].text == " t9 t10" and r.usage.prompt_tokens == 2  # this tokenizer adds no BOS


def _boom():
    raise ValueError("no such checkpoint: /nowhere")


def _bug():
    return {}["missing"]


def test_engine_process_start_failure_names_the_cause():
    """A user's error (bad checkpoint, option, memory) comes back as its message alone; a bug with its traceback."""
    from speedcore.server.engine_process import EngineProcessError, RemoteBackend

    with pytest.raises(EngineProcessError, match="ValueError: no such checkpoint: /nowhere") as e:
        RemoteBackend(_boom, start_timeout=120)
    assert "Traceback" not in str(e.value)
    with pytest.raises(EngineProcessError, match="KeyError: 'missing'") as e:
        RemoteBackend(_bug, start_timeout=120)
    assert "Traceback" in str(e.value) and "_bug" in str(e.value)


def _free_blocks(backend):
    return backend.llm.block_manager.num_free_blocks


def _unpicklable(backend):
    return lambda: None


def test_engine_process_runs_ahead_without_deadlock():
    """The engine process steps on its own while the parent reads nothing; the parent then sends a batch of long
    prompts larger than any pipe buffer.  Were the engine to block sending its deltas (the pipe to the parent
    full) while the parent blocks sending commands, both would wait forever; every request must finish."""
    import functools
    import threading

    from speedcore.engine.sampling_params import SamplingParams
    from speedcore.server.engine_process import EngineProcessError, RemoteBackend

    backend = RemoteBackend(functools.partial(make_fake_llm, max_model_len=4096, max_num_seqs=256,
                                              max_num_batched_tokens=512), start_timeout=120)
    result = {}

    def drive():
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        for i in range(64):
            backend.add(f"a{i}", None, [5 + i % 7] * 8, params)
        backend.step()
        time.sleep(1.0)  # the engine fills the pipe back with deltas meanwhile
        for i in range(200):
            backend.add(f"b{i}", None, list(range(5, 5 + 3000)), SamplingParams(max_tokens=1, temperature=0))
        done = set()
        while backend.has_unfinished():
            done.update(d.request_id for d in backend.step() if d.finished)
        result["done"] = done

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    t.join(120)
    try:
        assert not t.is_alive(), "the engine process and its parent deadlocked"
        assert len(result["done"]) == 264
        with pytest.raises(EngineProcessError, match="could not be sent back"):
            backend.run_call(_unpicklable)
        assert backend.run_call(_free_blocks) == backend.stats()["free_blocks"] > 0  # still serving
    finally:
        if t.is_alive():
            backend.process.kill()
        backend.close()


def test_engine_process_calls_and_a_dead_engine():
    """Calls run in the engine process (picklable functions only, with a clear error otherwise); once the engine
    process dies, requests get a 500 naming it and the server itself keeps answering."""
    import functools

    from speedcore.server.engine_process import EngineProcessError, RemoteBackend

    backend = RemoteBackend(functools.partial(make_fake_llm, max_model_len=64, max_num_seqs=4), start_timeout=120)
    try:
        with ServerThread(make_app(backend, served_model_name=MODEL)) as s:
            body = {"model": MODEL, "prompt": "t5 t6", "max_tokens": 3, "temperature": 0}
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t7 t8 t9"
            idle = s.engine.call(_free_blocks).result(30)
            assert idle == backend.stats()["free_blocks"] > 0
            with pytest.raises(EngineProcessError, match="picklable"):
                s.engine.call(lambda b: 1).result(30)
            backend.process.kill()
            backend.process.join(10)
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 500 and "engine process died" in r.text
            assert httpx.get(s.url + "/v1/models", timeout=30).status_code == 200
    finally:
        backend.close()


def test_take_step_report_counts_the_steps_since_the_last_call():
    from speedcore.engine.sampling_params import SamplingParams
    from speedcore.server import loadgen
    from speedcore.server.async_engine import LLMBackend

    backend = LLMBackend(make_fake_llm(max_model_len=64, max_num_seqs=4))
    backend.llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    report, steps, busy = loadgen.take_step_report(backend)
    assert steps == 5 and busy > 0 and "decode" in report and "prefill" in report
    assert loadgen.take_step_report(backend)[1:] == (0, 0)  # cleared
    assert "garbage collector, generation" in report and "between steps" not in report  # the latter: engine process only


def test_take_step_report_in_the_engine_process_has_the_time_between_steps():
    import functools

    from speedcore.engine.sampling_params import SamplingParams
    from speedcore.server import loadgen
    from speedcore.server.engine_process import RemoteBackend

    backend = RemoteBackend(functools.partial(make_fake_llm, max_model_len=64, max_num_seqs=4), start_timeout=120)
    try:
        backend.add("a", None, [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
        done = False
        while not done:
            done = any(d.finished for d in backend.step())
        report, steps, busy = backend.run_call(loadgen.take_step_report)
        assert steps == 6 and busy > 0
        line = [ln for ln in report.splitlines() if ln.startswith("between steps")]
        assert line and "commands" in line[0] and "reply" in line[0]
    finally:
        backend.close()


def test_cli_serve_stops_cleanly_on_ctrl_c():
    """`speedcore serve` (engine in its own process, the default) on Ctrl-C, which reaches the whole process group:
    exit 0, no traceback, no engine process left behind."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "speedcore", "serve", "--fake-engine", "--port", str(port),
                             "--max-num-seqs", "4", "--max-model-len", "64"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "t1 t2", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t4 t5"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
        deadline = time.monotonic() + 20  # multiprocessing's resource tracker leaves once its pipe closes
        while True:
            ps = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(proc.pid)], capture_output=True,
                                text=True)
            left = [ln for ln in ps.stdout.splitlines() if ln.split()[1][0] != "Z"]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, f"left behind: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_engine_process_prompt_ids_travel_packed_and_bad_ones_are_refused():
    """Prompt ids cross the pipe as an int64 array; the engine's checks still name what is wrong, and ids too big
    for int64 travel as a list to be refused the same way."""
    import functools

    from speedcore.engine.sampling_params import SamplingParams
    from speedcore.server.engine_process import RemoteBackend

    backend = RemoteBackend(functools.partial(make_fake_llm, vocab_size=1000, max_model_len=64, max_num_seqs=4),
                            start_timeout=120)
    try:
        sp = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
        backend.add("ok", None, [5, 6, 7], sp)
        backend.add("neg", None, [5, -1], sp)
        backend.add("big", None, [5, 1000], sp)
        backend.add("huge", None, [5, 2 ** 70], sp)
        got = {}
        while len([d for d in got.values() if d.finished]) < 4:
            for d in backend.step():
                got[d.request_id] = got[d.request_id].merge(d) if d.request_id in got else d
        assert got["ok"].token_ids == [8, 9, 10] and got["ok"].error is None
        for rid, shown in (("neg", "-1..5"), ("big", "5..1000"), ("huge", f"5..{2 ** 70}")):
            assert got[rid].finish_reason == "error" and "[0, 1000)" in got[rid].error and shown in got[rid].error
    finally:
        backend.close()
