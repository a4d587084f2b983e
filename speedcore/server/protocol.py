"""The OpenAI protocol: request bodies -> SamplingParams (or an APIError naming the field), engine Deltas ->
response bodies and stream chunks.  No Starlette here: plain dicts and bytes."""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import List, Optional

from ..engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20
MAX_STOP = 16


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else
                             "server_overloaded" if status == 503 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict:
    """Strict UTF-8, strict JSON (no NaN / Infinity), an object at the top, no lone surrogates in strings."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})",
                  code="invalid_utf8") from None
    if not text.strip():
        raise bad("the request body is empty: expected a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _check_text(s: str, param: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{param}: contains a lone surrogate (\\ud800-\\udfff), not valid Unicode text", param) from None
    return s


def _type_name(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def get_bool(body: dict, name: str, default: Optional[bool]) -> Optional[bool]:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name}: expected a boolean, got {_type_name(v)}", name)
    return v


def get_int(body: dict, name: str, default: Optional[int], lo: Optional[int] = None,
            hi: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name}: expected an integer, got {_type_name(v)}", name)
    if lo is not None and v < lo:
        raise bad(f"{name}: must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"{name}: must be <= {hi}, got {v}", name)
    return v


def get_float(body: dict, name: str, default: Optional[float], lo: Optional[float] = None,
              hi: Optional[float] = None, lo_open: bool = False) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"{name}: expected a finite number, got {_type_name(v)}", name)
    v = float(v)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise bad(f"{name}: must be {'>' if lo_open else '>='} {lo:g}, got {v:g}", name)
    if hi is not None and v > hi:
        raise bad(f"{name}: must be <= {hi:g}, got {v:g}", name)
    return v


def get_str(body: dict, name: str, default: Optional[str] = None) -> Optional[str]:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(f"{name}: expected a string, got {_type_name(v)}", name)
    return _check_text(v, name)


@dataclass
class GenerationRequest:
    """What both endpoints hand to the engine, after validation."""
    kind: str  # "completion" or "chat"
    model: str
    prompt: Optional[str]  # text (None for token-id prompts)
    prompt_token_ids: Optional[List[int]]
    messages: Optional[list]
    params: dict  # SamplingParams fields but max_tokens
    max_tokens: Optional[int]  # None: the rest of the context
    stream: bool
    include_usage: bool
    logprobs: Optional[int]  # top-n per token (0: the sampled token's only), None: no logprobs
    chat_template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    return_token_ids: bool = False

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **self.params)
        except ValueError as e:  # "SamplingParams.top_k: ..." -> param top_k
            msg = str(e)
            name = msg.split(":", 1)[0].split(".")[-1] if msg.startswith("SamplingParams.") else None
            raise bad(msg.replace("SamplingParams.", "", 1), name) from None


def _unsupported(body: dict, name: str, allowed=(None,), why: str = "") -> None:
    v = body.get(name)
    if v not in allowed and not (isinstance(v, (dict, list)) and not v and None in allowed):
        raise bad(f"{name}: {why or 'not supported by this server'} (got {json.dumps(v)[:60]})", name)


def _common(body: dict, kind: str, served_model: str) -> dict:
    model = body.get("model")
    if model is None:
        model = served_model
    elif not isinstance(model, str):
        raise bad(f"model: expected a string, got {_type_name(model)}", "model")
    elif model != served_model:
        raise APIError(404, f"The model {model!r} does not exist; this server serves {served_model!r}",
                       param="model", code="model_not_found")
    n = get_int(body, "n", 1, lo=1)
    if n != 1:
        raise bad(f"n: only n = 1 is supported, got {n} (send the request {n} times, with different seeds)", "n")
    best_of = get_int(body, "best_of", None, lo=1)
    if best_of not in (None, 1):
        raise bad(f"best_of: only 1 is supported, got {best_of}", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        v = get_float(body, name, 0.0)
        if v != 0.0:
            raise bad(f"{name}: not supported (only 0), got {v:g}", name)
    rp = get_float(body, "repetition_penalty", 1.0)
    if rp != 1.0:
        raise bad(f"repetition_penalty: not supported (only 1), got {rp:g}", "repetition_penalty")
    _unsupported(body, "logit_bias")
    stream = get_bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad(f"stream_options: expected an object, got {_type_name(so)}", "stream_options")
        if not stream:
            raise bad("stream_options: only allowed with stream: true", "stream_options")
        include_usage = bool(get_bool(so, "include_usage", False))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad(f"stop: expected a string or an array of strings, got {_type_name(stop)}", "stop")
        if len(stop) > MAX_STOP:
            raise bad(f"stop: at most {MAX_STOP} stop sequences, got {len(stop)}", "stop")
        if any(not s for s in stop):
            raise bad("stop: stop sequences must not be empty", "stop")
        stop = [_check_text(s, "stop") for s in stop]
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or
                                 any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in stop_ids)):
        raise bad("stop_token_ids: expected an array of non-negative integers", "stop_token_ids")
    top_k = get_int(body, "top_k", -1, lo=-1)
    params = dict(
        temperature=get_float(body, "temperature", 1.0, lo=0.0),
        top_p=get_float(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=top_k,
        min_p=get_float(body, "min_p", 0.0, lo=0.0, hi=1.0),
        min_tokens=get_int(body, "min_tokens", 0, lo=0),
        seed=get_int(body, "seed", None, lo=-(2 ** 63), hi=2 ** 64 - 1),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=get_bool(body, "ignore_eos", False),
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
    )
    if params["seed"] is not None and params["seed"] >= 2 ** 63:  # uint64 seeds as the int64 of the same bits
        params["seed"] -= 2 ** 64
    return dict(model=model, stream=stream, include_usage=include_usage, params=params,
                return_token_ids=get_bool(body, "return_token_ids", False))


def parse_completion(body: dict, served_model: str, vocab_size: int) -> GenerationRequest:
    c = _common(body, "completion", served_model)
    if get_bool(body, "echo", False):
        raise bad("echo: true is not supported (the prompt is not repeated in the output)", "echo")
    _unsupported(body, "suffix", (None, ""), "not supported (no fill-in-the-middle)")
    prompt = body.get("prompt")
    text, ids = None, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text = _check_text(prompt, "prompt")
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise bad("prompt: the token-id array is empty", "prompt")
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= vocab_size:
            raise bad(f"prompt: token ids must lie in [0, {vocab_size}), got {lo}..{hi}", "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(f"prompt: one prompt per request is supported, got {len(prompt)}", "prompt")
    elif prompt is None:
        raise bad("prompt: required", "prompt")
    else:
        raise bad(f"prompt: expected a string or an array of token ids, got {_type_name(prompt)}", "prompt")
    lp = get_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    max_tokens = get_int(body, "max_tokens", 16, lo=1)
    return GenerationRequest("completion", c["model"], text, ids, None, c["params"], max_tokens, c["stream"],
                             c["include_usage"], lp, return_token_ids=c["return_token_ids"])


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _check_text(content, f"messages[{i}].content")
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else _type_name(p)
                raise bad(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}",
                          f"messages[{i}].content")
            parts.append(_check_text(p["text"], f"messages[{i}].content"))
        return "".join(parts)
    raise bad(f"messages[{i}].content: expected a string or an array of text parts, got {_type_name(content)}",
              f"messages[{i}].content")


def parse_chat(body: dict, served_model: str) -> GenerationRequest:
    c = _common(body, "chat", served_model)
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages: required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad(f"messages: expected a non-empty array of messages, got {_type_name(msgs)}", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]: expected an object, got {_type_name(m)}", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role: expected one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}",
                      f"messages[{i}].role")
        out.append({"role": "system" if role == "developer" else role, "content": _message_text(m.get("content"), i)})
    _unsupported(body, "tools", (None,), "tool calling is not supported")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise bad("response_format: only {\"type\": \"text\"} is supported", "response_format")
    lp = None
    if get_bool(body, "logprobs", False):
        lp = get_int(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        get_int(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
        raise bad("top_logprobs: needs logprobs: true", "top_logprobs")
    mt = get_int(body, "max_completion_tokens", None, lo=1)
    max_tokens = get_int(body, "max_tokens", mt, lo=1)
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise bad(f"chat_template_kwargs: expected an object, got {_type_name(ctk)}", "chat_template_kwargs")
    return GenerationRequest("chat", c["model"], None, None, out, c["params"], max_tokens, c["stream"],
                             c["include_usage"], lp, chat_template_kwargs=dict(ctk or {}),
                             add_generation_prompt=get_bool(body, "add_generation_prompt", True),
                             return_token_ids=c["return_token_ids"])


# -- responses ------------------------------------------------------------------------------------------------------
class TokenText:
    """Token strings for logprobs (cached: the same ids come back every step)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache = {}

    def __call__(self, i: int) -> str:
        s = self.cache.get(i)
        if s is None:
            if self.tok is None:
                s = f"token_id:{i}"
            else:
                s = self.tok.decode([i], skip_special_tokens=False)
            if len(self.cache) < 200_000:
                self.cache[i] = s
        return s


def _top(d: dict, n: int):
    return sorted(d.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(token_ids, logprobs, n: int, token_text: TokenText, offset: int) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    toks, lps, tops, offs = [], [], [], []
    for t, d in zip(token_ids, logprobs):
        s = token_text(t)
        toks.append(s)
        lps.append(d.get(t))
        tops.append({token_text(k): v for k, v in _top(d, n)} if n else None)
        offs.append(offset)
        offset += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def chat_logprobs(token_ids, logprobs, n: int, token_text: TokenText) -> List[dict]:
    out = []
    for t, d in zip(token_ids, logprobs):
        s = token_text(t)
        out.append({"token": s, "logprob": d.get(t), "bytes": list(s.encode("utf-8", "replace")),
                    "top_logprobs": [{"token": token_text(k), "logprob": v,
                                      "bytes": list(token_text(k).encode("utf-8", "replace"))}
                                     for k, v in _top(d, n)]})
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def finish_reason(reason: Optional[str]) -> Optional[str]:
    return reason if reason in (None, "stop", "length") else "stop"


def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


DONE = b"data: [DONE]\n\n"


class ChunkWriter:
    """Stream chunks of one request, in the format of its endpoint."""

    def __init__(self, req: GenerationRequest, rid: str, token_text: TokenText):
        self.req, self.rid, self.tt = req, rid, token_text
        self.created = int(time.time())
        self.chat = req.kind == "chat"
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.offset = 0
        self._prefix: Optional[bytes] = None

    def _wrap(self, choices, usage_=None, with_usage_field=True) -> bytes:
        obj = {"id": self.rid, "object": self.object, "created": self.created, "model": self.req.model,
               "choices": choices}
        if self.req.include_usage and with_usage_field:
            obj["usage"] = usage_
        return sse(obj)

    def first(self) -> Optional[bytes]:
        if self.chat:
            return self._wrap([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
        return None

    def _fast_prefix(self) -> bytes:
        head = json.dumps({"id": self.rid, "object": self.object, "created": self.created, "model": self.req.model},
                          ensure_ascii=False, separators=(",", ":"))[:-1]
        field = '"delta":{"content":' if self.chat else '"text":'
        return ("data: " + head + ',"choices":[{"index":0,' + field).encode("utf-8")

    def delta(self, d) -> bytes:
        if not d.finished and self.req.logprobs is None and not self.req.return_token_ids:
            # the common chunk, without building its dict (once per token per stream)
            if self._prefix is None:
                self._prefix = self._fast_prefix()
                self._tail = (b'}' if self.chat else b'') + b',"logprobs":null,"finish_reason":null}]' + \
                    (b',"usage":null' if self.req.include_usage else b'') + b'}\n\n'
            return self._prefix + json.dumps(d.text, ensure_ascii=False).encode("utf-8") + self._tail
        fr = finish_reason(d.finish_reason) if d.finished else None
        lp = None
        if self.req.logprobs is not None and d.logprobs:
            lp = (chat_logprobs(d.token_ids, d.logprobs, self.req.logprobs, self.tt) if self.chat else
                  completion_logprobs(d.token_ids, d.logprobs, self.req.logprobs, self.tt, self.offset))
            if self.chat:
                lp = {"content": lp}
        self.offset += len(d.text)
        if self.chat:
            choice = {"index": 0, "delta": {"content": d.text} if d.text or not d.finished else {}, "logprobs": lp,
                      "finish_reason": fr}
        else:
            choice = {"index": 0, "text": d.text, "logprobs": lp, "finish_reason": fr}
        if d.finished:
            choice["stop_reason"] = d.stop_reason
        if self.req.return_token_ids:
            choice["token_ids"] = d.token_ids
        return self._wrap([choice])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int = 0) -> bytes:
        return self._wrap([], usage(prompt_tokens, completion_tokens, cached))


def full_response(req: GenerationRequest, rid: str, text: str, token_ids: List[int], logprobs, reason,
                  stop_reason, prompt_tokens: int, cached: int, token_text: TokenText,
                  prompt_token_ids: Optional[List[int]] = None) -> dict:
    lp = None
    if req.logprobs is not None:
        lp = (chat_logprobs(token_ids, logprobs or [], req.logprobs, token_text) if req.kind == "chat" else
              completion_logprobs(token_ids, logprobs or [], req.logprobs, token_text, 0))
        if req.kind == "chat":
            lp = {"content": lp}
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                  "finish_reason": finish_reason(reason), "stop_reason": stop_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason(reason),
                  "stop_reason": stop_reason}
        obj = "text_completion"
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": req.model, "choices": [choice],
           "usage": usage(prompt_tokens, len(token_ids), cached)}
    if req.return_token_ids and prompt_token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    return out
