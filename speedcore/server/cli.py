"""``python -m speedcore serve``: the OpenAI-compatible server (docs/server.md).  Importing this module is light:
Starlette, uvicorn and the engine load when the command runs."""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys


def add_parser(sub) -> dict:
    """Add ``serve`` to ``sub`` (argparse subparsers); returns {"serve": handler}."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on speedcore.LLM (docs/server.md)")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face model directory (config.json, safetensors, tokenizer.json)")
    src.add_argument("--preset", help="random-weight model built on the GPU (llama-3-8b, llama-3.2-1b, tiny), "
                                      "with a word-per-token tokenizer ('t17 t4 ...'): for benchmarks")
    src.add_argument("--fake-engine", action="store_true",
                     help="no GPU: the CPU stand-in of the tests (a counting model), to try the API")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("SPEEDCORE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPEEDCORE_API_KEY; none: no check)")
    s.add_argument("--served-model-name", help="the model name clients send (default: the --model argument)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond the max_num_seqs running; more get 503 (default 256)")
    s.add_argument("--max-request-bytes", type=int, default=2 << 20, help="request body limit: 413 past it")
    s.add_argument("--max-prompt-chars", type=int, default=1 << 20, help="prompt length limit before tokenizing")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off (on by default)")
    s.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    s.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--fake-step-delay", type=float, default=0.02, help="with --fake-engine: seconds per step")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own (default; the HTTP side and the engine then do not "
                        "share one interpreter lock: 0.84x offline throughput under load against 0.55x in one "
                        "process, H200, 1B preset); --no-engine-process keeps it in a thread of the server")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(enable_prefix_caching=True)
    return {"serve": main}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_llm(args):
    """(the engine, the served model name) for the parsed arguments."""
    if args.fake_engine:
        from .fake_engine import make_fake_llm

        llm = make_fake_llm(max_model_len=args.max_model_len or 2048, max_num_seqs=min(args.max_num_seqs, 256),
                            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                            step_delay=args.fake_step_delay, enable_prefix_caching=args.enable_prefix_caching,
                            seed=args.seed)
        return llm, args.served_model_name or "fake"
    from ..engine import LLM

    model = args.model if args.model else f"preset:{args.preset}"
    llm = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
              block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
              enforce_eager=args.enforce_eager, seed=args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.preset:
        from .fake_engine import attach_number_tokenizer

        attach_number_tokenizer(llm)
    return llm, args.served_model_name or model


def _engine_of(args):
    """The engine alone (engine_process's factory: runs in the engine process)."""
    return build_llm(args)[0]


def main(args) -> int:
    for name in ("max_queue", "max_request_bytes", "max_prompt_chars"):
        if getattr(args, name) < (0 if name == "max_queue" else 1):
            raise SystemExit(f"speedcore serve: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"speedcore serve: --port must be in 0..65535, got {args.port}")
    try:
        import uvicorn

        from .runner import make_app, uvicorn_config
    except ImportError as e:
        raise SystemExit(f"speedcore serve needs the server packages ({e.name}): pip install 'speedcore[serve]'")
    if not _is_loopback(args.host) and not args.api_key:
        print(f"speedcore serve: WARNING: binding {args.host} without --api-key: anyone who reaches this address "
              f"can use the model", file=sys.stderr, flush=True)
    try:
        if args.engine_process:
            import functools

            from .engine_process import EngineProcessError, RemoteBackend

            try:
                llm = RemoteBackend(functools.partial(_engine_of, args))
            except EngineProcessError as e:
                raise SystemExit(f"speedcore serve: {e}") from None
            name = args.served_model_name or ("fake" if args.fake_engine else args.model or f"preset:{args.preset}")
        else:
            llm, name = build_llm(args)
    except (FileNotFoundError, ValueError, MemoryError) as e:  # a bad checkpoint, config, tokenizer or option
        raise SystemExit(f"speedcore serve: {type(e).__name__}: {e}") from None
    try:
        app = make_app(llm, served_model_name=name, api_key=args.api_key, max_queue=args.max_queue,
                       max_request_bytes=args.max_request_bytes, max_prompt_chars=args.max_prompt_chars)
        print(f"speedcore serve: {name!r} (max_model_len {llm.max_model_len}) on http://{args.host}:{args.port}/v1"
              f"{' (API key required)' if args.api_key else ''}", file=sys.stderr, flush=True)
        try:
            uvicorn.Server(uvicorn_config(app, args.host, args.port, log_level=args.log_level)).run()
        except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then re-raises it
            pass
    finally:
        llm.close()
    return 0
