"""lumen bench precision: what a lower-precision option costs in accuracy, and buys in speed.

For each ``--dtypes`` setting (the model's weights, activations and KV cache
in that dtype), each ``--kv-cache-dtypes`` setting (a float32 model over a
KV cache in that dtype) and each ``--quantizations`` setting (a float32 model
with its decoder layers' weights quantized) against float32, on the same
weights, in one run:

- **greedy agreement**: a fixed set of chat prompts generated greedily
  through the offline LLM; the share of prompts whose whole output equals
  float32's, and the mean share of each output that matches float32's up to
  its first difference;
- **logits**: float32's prompt + output sequences fed to each model, the
  prompt in one prefill step and each output token in a decode step of its
  own (so the outputs' logits read the KV cache, as a generation's do); the
  largest absolute logit difference from float32's at any position, and the
  share of positions whose top token is float32's;
- **perplexity** on a fixed text (TEXT, a few paragraphs of plain English prose), prefilled in
  one step: the exponent of the mean negative log-likelihood of each next token;
- **speed**: a 512-token prefill step and batch-1 and batch-16 decode steps
  at context 128 (the worker's own step, fastest of several), and the
  generation's wall time.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from bench.common import check_json_path, gguf_file, machine, print_table, write_json
from bench.roofline import StepTimer
from engine.config import KV_8BIT, check_quantization

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What causes the seasons on Earth?",
    "Give me a short tip for learning to cook.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What is 17 times 3?",
    "Name a famous painting by Vincent van Gogh.",
    "Why is the sky blue?",
    "Write a one-line Python function that reverses a string.",
    "What does a thermometer measure?",
    "Suggest a name for a pet turtle.",
    "What is the boiling point of water at sea level?",
)
DTYPES = ("float32", "bfloat16", "float16")
# The perplexity text: plain prose any small chat model has seen the like of (written for this).
TEXT = (
    "The river rises in the hills to the north, where the snow lies late into spring. For most "
    "of the year it is a quiet stream that a child could cross on stepping stones, but when the "
    "snow melts it fills its banks and carries whole trees down to the valley. The farmers who "
    "live along it have learned to build their houses on the higher ground and to plant their "
    "fields only after the water has gone down. In the town at the mouth of the valley there is "
    "an old stone bridge with five arches. It was built more than three hundred years ago, and "
    "it has survived every flood since, although the road that crosses it has been repaired "
    "many times. In the summer, tourists stop on the bridge to take pictures of the water and "
    "the mountains behind it, and in the evening the swallows fly low over the river to catch "
    "insects. The people of the town say that the river has a long memory: it remembers every "
    "wall that was built too close to it, and sooner or later it comes back to take it away."
)


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "precision",
        help="accuracy and speed of lower-precision dtypes and int8 / int4 weights vs fp32",
    )
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--dtypes", default="bfloat16", help=f"dtypes to compare with float32 ({', '.join(DTYPES)})"
    )
    p.add_argument(
        "--kv-cache-dtypes",
        default="",
        help="KV cache dtypes to compare, each under a float32 model (bfloat16, float16, int8, "
        "fp8)",
    )
    p.add_argument(
        "--quantizations",
        default="",
        help="weight quantizations to compare, each on a float32 model (int8, int4, gguf: the "
        "GGUF file the model comes from, in its own formats)",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="greedy output tokens per prompt")
    p.add_argument(
        "--chat-template",
        default=None,
        help="the prompts' chat template, for a model that has none (a file, a built-in name "
        "or Jinja, as lumen serve's; e.g. gemma for the packaged Gemma 3 270M)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.model_files import resolve_model

    dtypes = ["float32", *(d.strip() for d in args.dtypes.split(",") if d.strip())]
    kv_dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    for flag, given, known in (("--dtypes", dtypes, DTYPES),
                               ("--kv-cache-dtypes", kv_dtypes, (*DTYPES, *KV_8BIT))):  # fmt: skip
        bad = [d for d in given if d not in known]
        if bad:
            raise ValueError(f"{flag}: {', '.join(bad)} not one of {', '.join(known)}")
    quantizations = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    for q in quantizations:
        check_quantization(q)
    # (label, model dtype, KV cache dtype, quantization); float32 first: the reference
    settings: list[tuple[str, str, str, str | None]] = [
        (d, d, d, None) for d in dict.fromkeys(dtypes)
    ]
    settings += [(f"float32, KV {d}", "float32", d, None) for d in dict.fromkeys(kv_dtypes)]
    settings += [(f"float32, {q} weights", "float32", "float32", q)
                 for q in dict.fromkeys(quantizations)]  # fmt: skip
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    check_json_path(args.json)
    path = str(resolve_model(args.model))
    # gguf runs the file's own blocks: the model's GGUF file (the same fp32 weights converted)
    gguf_path = str(resolve_model(str(gguf_file(args.model)))) if "gguf" in quantizations else path
    from transformers import AutoTokenizer

    text_ids = list(AutoTokenizer.from_pretrained(path)(TEXT)["input_ids"])
    results: dict[str, dict[str, Any]] = {}
    reference: list[list[int]] = []
    ref_logits: list[torch.Tensor] = []
    for label, dtype, kv_dtype, quantization in settings:
        where = gguf_path if quantization == "gguf" else path
        outputs, prompts, gen_s = _generate(
            where, dtype, kv_dtype, quantization, args.max_tokens, args.chat_template
        )
        if label == "float32":
            reference = outputs
        timer = StepTimer(
            where, torch.device("cpu"), getattr(torch, dtype),
            getattr(torch, KV_8BIT.get(kv_dtype, kv_dtype)),
            quantization,
        )  # fmt: skip
        sequences = [p + o for p, o in zip(prompts, reference)]
        logits = [timer.logits(seq, len(p)) for seq, p in zip(sequences, prompts)]
        perplexity = _perplexity(timer.logits(text_ids), text_ids)
        if label == "float32":
            ref_logits = logits
        prefill_s = timer.prefill_step(512)
        decode_s = min(timer.decode_step(16, 128) for _ in range(2))
        decode1_s = min(timer.decode_step(1, 128) for _ in range(3))
        timer.release()
        del timer
        gc.collect()
        results[label] = {
            **_agreement(outputs, reference),
            **_logit_diff(logits, ref_logits),
            "perplexity": perplexity,
            "generate_s": gen_s,
            "prefill_512_s": prefill_s,
            "decode_b16_ctx128_s": decode_s,
            "decode_b1_ctx128_s": decode1_s,
        }
    base = results["float32"]
    rows = [
        [
            dtype,
            f"{r['exact_outputs']:.0%}",
            f"{r['matching_prefix']:.0%}",
            f"{r['max_logit_diff']:.3f}",
            f"{r['top1_agreement']:.1%}",
            f"{r['perplexity']:.3f}",
            f"{r['prefill_512_s'] * 1e3:.0f} ({base['prefill_512_s'] / r['prefill_512_s']:.2f}x)",
            f"{r['decode_b1_ctx128_s'] * 1e3:.1f} "
            f"({base['decode_b1_ctx128_s'] / r['decode_b1_ctx128_s']:.2f}x)",
            f"{r['decode_b16_ctx128_s'] * 1e3:.1f} "
            f"({base['decode_b16_ctx128_s'] / r['decode_b16_ctx128_s']:.2f}x)",
            f"{r['generate_s']:.2f}",
        ]
        for dtype, r in results.items()
    ]
    print(f"\n{len(PROMPTS)} chat prompts, {args.max_tokens} greedy tokens each; "
          f"{machine()['device_name']}, {torch.get_num_threads()} threads")  # fmt: skip
    print_table(
        ["setting", "same output", "matching prefix", "max |logit diff|", "top-1 same",
         f"perplexity ({len(text_ids)} tokens)", "prefill 512 ms", "decode b1 ms",
         "decode b16 ms", "generate s"],
        rows,
    )  # fmt: skip
    ratios = (
        {
            f"{_key(d)}_prefill_speedup_ratio": base["prefill_512_s"] / r["prefill_512_s"]
            for d, r in results.items()
        }
        | {
            f"{_key(d)}_decode_speedup_ratio": base["decode_b16_ctx128_s"]
            / r["decode_b16_ctx128_s"]
            for d, r in results.items()
        }
        | {
            f"{_key(d)}_decode_b1_speedup_ratio": base["decode_b1_ctx128_s"]
            / r["decode_b1_ctx128_s"]
            for d, r in results.items()
        }
    )
    write_json(args.json, {"machine": machine(), "results": results, **ratios})
    return 0


def _generate(
    path: str, dtype: str, kv_dtype: str, quantization: str | None, max_tokens: int,
    chat_template: str | None = None,
) -> tuple[list[list[int]], list[list[int]], float]:  # fmt: skip
    from engine import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, kv_cache_dtype=kv_dtype, quantization=quantization,
              enable_prefix_caching=False)  # fmt: skip
    try:
        conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.chat(conversations, params, use_tqdm=False, chat_template=chat_template)
        seconds = time.perf_counter() - t0
    finally:
        llm.shutdown()
    prompts = [list(o.prompt_token_ids) for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs], prompts, seconds


def _key(label: str) -> str:
    """A setting's label as a JSON key: "float32, KV bfloat16" -> "float32_kv_bfloat16"."""
    return label.lower().replace(", ", "_").replace(" ", "_")


def _agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    exact = sum(o == r for o, r in zip(outputs, reference)) / len(reference)
    shares = []
    for o, r in zip(outputs, reference):
        same = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
        shares.append(same / len(r))
    return {"exact_outputs": exact, "matching_prefix": sum(shares) / len(shares)}


def _perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp(mean NLL) of each token after the first, from the logits at the position before."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.tensor(token_ids[1:])
    return float(torch.exp(-logp[torch.arange(len(targets)), targets].mean()))


def _logit_diff(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, float]:
    worst, same, total = 0.0, 0, 0
    for got, ref in zip(logits, reference):
        worst = max(worst, (got - ref).abs().max().item())
        same += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
    return {"max_logit_diff": worst, "top1_agreement": same / total}
