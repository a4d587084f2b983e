"""speedcore.LLM: generate from a Hugging Face checkpoint directory, or from a random-weight preset (no download).

python examples/engine_generate.py /path/to/model "The capital of France is"
python examples/engine_generate.py preset:tiny
"""
import sys

from speedcore import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "preset:tiny"
prompt = sys.argv[2] if len(sys.argv) > 2 else "Hello"
with LLM(model, max_model_len=2048, gpu_memory_utilization=0.5, log=print) as llm:
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=llm.tokenizer is None)
    req = prompt if llm.tokenizer is not None else [1, 2, 3, 4]  # presets have no tokenizer: token ids
    out = llm.generate([req], sp, use_tqdm=False)[0]
    print(out.outputs[0].token_ids if llm.tokenizer is None else out.outputs[0].text)
    print(f"TTFT {out.metrics.ttft * 1e3:.1f} ms, {len(out.outputs[0].token_ids)} tokens, "
          f"finish reason {out.outputs[0].finish_reason}")
