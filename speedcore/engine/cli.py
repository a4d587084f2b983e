"""``python -m speedcore generate``, ``python -m speedcore bench-engine`` and ``python -m speedcore quantize``."""
from __future__ import annotations

import json
import sys
import time
from typing import Optional

import numpy as np

from .quantization import QUANT_COPIES

COPY_BYTES_PER_S = 4.3e12  # H200 device copy rate (README: 4.21-4.27 TB/s measured)
GEMM_FLOPS_PER_S = 790e12  # H200 bf16 dense GEMM rate used for the roofline


def add_parsers(sub) -> dict:
    """Add the engine subcommands to ``sub`` (argparse subparsers); returns {name: handler}."""
    g = sub.add_parser("generate", help="generate text with speedcore.LLM from a Hugging Face model directory")
    g.add_argument("prompt", nargs="+", help="one or more prompts")
    g.add_argument("--model", required=True, help="model directory (config.json, safetensors, tokenizer.json)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="render each prompt as a user turn with the chat template")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (one process each, NCCL)")
    b = sub.add_parser("bench-engine", help="offline throughput / latency of speedcore.LLM (random token ids)")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory (default: --preset)")
    src.add_argument("--preset", default=None, help="random-weight model built on the GPU: llama-3-8b (default), "
                                                    "llama-3.2-1b, llama-3-70b, tiny")
    b.add_argument("--num-prompts", type=int, default=256)
    b.add_argument("--input-len", default="100:1024", help="A:B (uniform) or N")
    b.add_argument("--output-len", default="256", help="A:B (uniform) or N")
    b.add_argument("--batch", type=int, default=256, help="max_num_seqs (1: latency mode)")
    b.add_argument("--max-num-batched-tokens", type=int, default=8192)
    b.add_argument("--max-model-len", type=int, default=None, help="default: longest input + output")
    b.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--enforce-eager", action="store_true")
    b.add_argument("--no-prefix-caching", action="store_true")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--profile", action="store_true",
                   help="NVTX range per step (for nsys) and a sync after each forward: time per step kind and phase")
    b.add_argument("--quantization", choices=("awq", "gptq", "int8"), default=None,
                   help="with --preset: 4-bit AWQ / GPTQ (g128) or INT8 weight-only linears (random codes in the "
                        "format); a --model checkpoint's own quantization_config decides")
    b.add_argument("--quant-copies", choices=QUANT_COPIES, default="compact",
                   help="layout copies the quantized linears keep (docs/quantization.md)")
    b.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs to shard the model over (one process each, NCCL; docs/engine.md)")
    b.add_argument("--json", help="write the results to this JSON file")
    q = sub.add_parser("quantize", help="round-to-nearest quantization of a Hugging Face checkpoint into AutoAWQ / "
                                        "AutoGPTQ's format (or speedcore's INT8 layout); NumPy only, no GPU")
    q.add_argument("src", help="float checkpoint directory (config.json, safetensors)")
    q.add_argument("dst", help="output directory")
    q.add_argument("--method", choices=("awq", "gptq", "int8"), default="awq")
    q.add_argument("--group-size", type=int, default=128, help="G (-1: one group over K, GPTQ only)")
    q.add_argument("--desc-act", action="store_true", help="GPTQ act-order (order: docs/quantization.md)")
    q.add_argument("--asym", action="store_true", help="GPTQ sym=false (min/max zero points)")
    q.add_argument("--max-shard-size", default="5GB")
    q.add_argument("--no-progress", action="store_true")
    return {"generate": generate_main, "bench-engine": bench_main, "quantize": quantize_main}


def quantize_main(args) -> int:
    from ..quant.checkpoint import quantize_checkpoint

    try:
        qc = quantize_checkpoint(args.src, args.dst, args.method, args.group_size, desc_act=args.desc_act,
                                 sym=not args.asym, progress=not args.no_progress, max_shard_size=args.max_shard_size)
    except (ValueError, OSError) as e:
        raise SystemExit(f"speedcore quantize: {e}") from None
    print(f"{args.dst}: quantization_config {json.dumps(qc)}")
    return 0


def _range(s: str) -> tuple:
    a, _, b = str(s).partition(":")
    lo, hi = int(a), int(b or a)
    if not 1 <= lo <= hi:
        raise SystemExit(f"bad length range {s!r}: expected A:B with 1 <= A <= B")
    return lo, hi


def generate_main(args) -> int:
    from . import LLM, SamplingParams

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        seed=args.seed)
    with LLM(args.model, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
             tensor_parallel_size=args.tensor_parallel_size, log=lambda m: print(m, file=sys.stderr)) as llm:
        if args.chat:
            prompts = []
            for p in args.prompt:
                text = llm.tokenizer.apply_chat_template([dict(role="user", content=p)])
                prompts.append(dict(prompt=text, prompt_token_ids=llm.tokenizer.encode(text, add_special_tokens=False)))
        else:
            prompts = list(args.prompt)
        if len(prompts) == 1:
            for d in llm.generate_stream(prompts, sp):
                print(d.text, end="", flush=True)
                if d.finished and d.output.error:
                    print(f"error: {d.output.error}", file=sys.stderr)
                    return 1
            print()
        else:
            for o in llm.generate(prompts, sp):
                print(f"--- {o.prompt!r}\n{o.outputs[0].text if o.error is None else 'error: ' + o.error}")
    return 0


def _pct(xs, qs=(50, 90, 99)) -> dict:
    if not len(xs):
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(xs, q)) for q in qs}


def roofline(cfg, weight_bytes: int, itemsize: int, in_lens, out_lens, batch: int, tensor_parallel_size: int = 1,
             kv_heads: Optional[int] = None) -> dict:
    """Lower bounds for the workload: weights read once per step (the fewest steps: each wave of ``batch``
    requests needs its longest output's steps), KV read by every decode token and written once, at the copy
    rate; GEMM and attention FLOPs at the GEMM rate.  The bound is the larger of the two.  Tensor parallelism:
    ``weight_bytes`` and ``kv_heads`` are one rank's (every GPU reads its shard at the copy rate at once: the
    aggregate read ceiling), the FLOPs split over the ranks."""
    in_lens, out_lens = np.asarray(in_lens, np.float64), np.asarray(out_lens, np.float64)
    n = len(in_lens)
    waves = [out_lens[i:i + batch].max() for i in range(0, n, batch)]
    steps = float(sum(waves))
    kv_tok = 2 * cfg.num_layers * (kv_heads or cfg.num_kv_heads) * cfg.head_dim * itemsize
    total_tok = float((in_lens + out_lens).sum())
    # decode token t of a request reads in + t cached tokens
    kv_read = float((out_lens * in_lens + out_lens * (out_lens - 1) / 2).sum()) * kv_tok
    bytes_ = steps * weight_bytes + kv_read + total_tok * kv_tok
    layer_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    ctx_sum = float((in_lens * (in_lens + 1) / 2 + out_lens * in_lens + out_lens * (out_lens + 1) / 2).sum())
    flops = 2 * layer_params * total_tok + 2 * cfg.vocab_size * cfg.hidden_size * float(out_lens.sum()) + \
        4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx_sum
    t_mem, t_flop = bytes_ / COPY_BYTES_PER_S, flops / tensor_parallel_size / GEMM_FLOPS_PER_S
    return dict(bytes=bytes_, flops=flops, memory_s=t_mem, compute_s=t_flop, roofline_s=max(t_mem, t_flop),
                min_steps=steps)


def bench_main(args) -> int:
    from . import LLM, SamplingParams

    model = args.model or f"preset:{args.preset or 'llama-3-8b'}"
    in_lo, in_hi = _range(args.input_len)
    out_lo, out_hi = _range(args.output_len)
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    in_lens = rng.integers(in_lo, in_hi + 1, n)
    out_lens = rng.integers(out_lo, out_hi + 1, n)
    from .config import load_config, preset_config

    if args.model and args.quantization:
        raise SystemExit("--quantization goes with --preset; a --model checkpoint's quantization_config decides")
    cfg = load_config(args.model) if args.model else preset_config(args.preset or "llama-3-8b", args.quantization)
    max_len = args.max_model_len or min(int(in_hi + out_hi), cfg.max_position_embeddings)
    if in_hi >= max_len:
        raise SystemExit(f"--input-len: {in_hi} tokens leave no room for output within max_model_len {max_len}")
    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=max_len, max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              enable_prefix_caching=not args.no_prefix_caching, seed=args.seed, skip_tokenizer_init=True,
              log=lambda m: print(m, file=sys.stderr), quantization=args.quantization, quant_copies=args.quant_copies,
              tensor_parallel_size=args.tensor_parallel_size)
    startup = time.perf_counter() - t0
    try:
        V = llm.config.vocab_size
        prompts = [rng.integers(0, V, int(L)).tolist() for L in in_lens]
        params = [SamplingParams(max_tokens=int(o), ignore_eos=True, temperature=args.temperature) for o in out_lens]
        # a warm-up request compiles whatever the start-up did not (sampling kernels, the prefill of the workload's
        # prompt length: a quantized model's kernels for 128 rows differ from those of 16; its own random ids, so
        # that the prefix cache gives the measured prompts nothing)
        warm = rng.integers(0, V, int(min(in_hi, max_len - 4))).tolist()
        llm.generate([warm], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        llm.step_stats.clear()
        llm.profile = args.profile
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - t1
        bad = [o.error for o in outs if o.error]
        if bad:
            print(f"{len(bad)} requests failed, e.g.: {bad[0]}", file=sys.stderr)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = int(in_lens.sum())
        ttft = [o.metrics.first_token_time - t1 for o in outs if o.metrics.first_token_time]
        itl = np.concatenate([np.diff(o.metrics.token_times) for o in outs if len(o.metrics.token_times) > 1] or
                             [np.zeros(0)])
        itemsize = 2
        weight_bytes = llm.model.nbytes()
        tp = args.tensor_parallel_size
        roof = roofline(llm.config, llm.model.streamed_bytes(), itemsize, in_lens, out_lens, args.batch, tp,
                        llm.model.num_kv_heads)  # rank 0's shard: every rank reads its own at once
        res = dict(op="engine", case=f"{args.preset or 'model'}-tp{tp}-batch{args.batch}", tensor_parallel_size=tp,
                   model=model, num_prompts=n, input_len=args.input_len, output_len=args.output_len,
                   batch=args.batch, max_model_len=llm.max_model_len, enforce_eager=args.enforce_eager,
                   elapsed_s=elapsed, input_tokens=n_in, output_tokens=n_out, output_tok_per_s=n_out / elapsed,
                   total_tok_per_s=(n_in + n_out) / elapsed, ttft_s=_pct(ttft), itl_s=_pct(itl),
                   startup_s=dict(total=startup, **llm.timings), kv_blocks=llm.num_gpu_blocks,
                   preemptions=llm.scheduler.num_preemptions, roofline=roof, profile=args.profile,
                   steps={k: dict(zip(("steps", "tokens", "schedule_s", "forward_s", "sample_s", "post_s", "gc_s"),
                                          v))
                          for k, v in llm.step_stats.items()},
                   roofline_fraction=roof["roofline_s"] / elapsed, weight_bytes=weight_bytes,
                   quantization=(llm.config.quantization.method if llm.config.quantization else None),
                   quant_copies=args.quant_copies)
        report = llm.step_report()
    finally:
        llm.close()
    ms = lambda d: " ".join(f"{k} {v * 1e3:.1f}" if v is not None else f"{k} -" for k, v in d.items())  # noqa: E731
    print(f"{model}: {n} prompts, {n_in} input + {n_out} output tokens in {elapsed:.2f} s")
    print(f"throughput: {res['output_tok_per_s']:.0f} output tok/s ({res['total_tok_per_s']:.0f} total tok/s)")
    print(f"weights on the GPU: {weight_bytes / 1e9:.2f} GB ({res['quantization'] or 'bf16'})"
          + (f" per rank, tensor_parallel_size {res['tensor_parallel_size']}" if res["tensor_parallel_size"] > 1
             else ""))
    print(f"TTFT ms: {ms(res['ttft_s'])}; inter-token latency ms: {ms(res['itl_s'])}")
    st = res["startup_s"]
    print(f"start-up: {st['total']:.2f} s (load {st.get('load_s', 0):.2f}, profile {st.get('profile_s', 0):.2f}, "
          f"graph capture {st.get('capture_s', 0):.2f}); KV blocks {res['kv_blocks']}, "
          f"preemptions {res['preemptions']}")
    print(f"roofline: {roof['roofline_s']:.2f} s (memory {roof['memory_s']:.2f} s: {roof['bytes'] / 1e12:.2f} TB at "
          f"{COPY_BYTES_PER_S / 1e12:.1f} TB/s; compute {roof['compute_s']:.2f} s: {roof['flops'] / 1e15:.2f} PFLOP at "
          f"{GEMM_FLOPS_PER_S / 1e12:.0f} TFLOP/s): measured is {elapsed / roof['roofline_s']:.2f}x the bound")
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
