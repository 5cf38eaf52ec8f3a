"""Generated scenarios with known causes: a seeded base load, and primitives whose effect is
known by construction, each one cause the diagnosis must name (CAUSES).

A group is one model and one base load (a few streams of random lengths, arriving together or
staggered; on a real model one at a time); its control runs the base load alone, and each of
its primitives runs the same load with one provocation added. A group that holds the
imbalance primitive is a deployment of two engines (two_engines): every run of it, its control
too, runs --data-parallel-size 2 with room on each engine for half the streams, and its prompts
share a prefix of more than half their KV blocks. Everything random comes from the
group's seed, so a group is replayed exactly (the same requests, flags and moments) from its seed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.diagnose.client import Ask

# The causes a primitive provokes, in the order the matrix lists them.
CAUSES = (
    "prefill", "max_num_seqs", "kv_blocks", "token_budget", "api_cpu", "grammar", "logprobs",
    "penalties", "slow_reader", "cancel", "crash", "hang", "gc", "imbalance", "speculation",
    "lora_slots",
)  # fmt: skip
# The speculation primitive's draft: a random model of SmolLM2's tokenizer (the tiny model's
# shape, another seed), its folder put in place of this by the bench (diagnose._models).
RANDOM_DRAFT = "@random-draft"
# The lora_slots primitive's adapters: random LoRA folders for the group's model, written by
# the bench (diagnose._lora_adapters) in a folder put in place of this.
LORA_ADAPTERS = "@lora-adapters"


@dataclass(frozen=True)
class Profile:
    """What a model's scenarios are sized by, on a 2-core CPU: a decode step at a few rows, the
    prompts a long prefill sends, how long base prompts may be, and how far apart the base
    load's streams arrive at least (``spaced_s``; 0: together or at random). On a real model
    a base prompt's prefill, or several arriving in one step, stalls the streams decoding
    beside them: that is the prefill primitive, which a healthy control must not hold."""

    name: str
    step_s: float
    long_prompt: tuple[int, int]
    base_prompt: tuple[int, int]
    min_tokens: int
    spaced_s: float = 0.0
    kv_groups: int = 1  # the KV cache's groups: each holds a block per 16 tokens of a request


PROFILES = {
    "tiny": Profile("tiny", 0.0012, (300, 1900), (8, 300), 64),
    "smollm2": Profile("smollm2", 0.028, (150, 1200), (8, 20), 12, spaced_s=0.12),
    # Gemma 3 270M: 3 global layers in 1 KV group, 15 sliding-window layers in 5.
    "gemma3": Profile("gemma3", 0.040, (120, 900), (8, 20), 10, spaced_s=0.16, kv_groups=6),
}
BLOCK = 16  # tokens a KV block holds (lumen serve's default)
CONTEXT = 2048  # the tiny model's context, the smallest of the three


@dataclass
class Action:
    """Something done to the server at a moment of the run: kill, stop and continue the core,
    or a GC pause in a process (SIGUSR2 under LUMEN_DEBUG_GC)."""

    kind: str  # kill_core | stop_core | gc_api | gc_core
    at_s: float
    seconds: float = 0.0  # stop_core: how long it stays stopped


@dataclass
class Run:
    """One server run: its flags, environment, requests and actions."""

    cause: str | None  # None: the control
    asks: list[Ask]
    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    magnitude: dict[str, Any] = field(default_factory=dict)  # what the primitive was made of


@dataclass
class Group:
    seed: int
    model: str
    control: Run
    primitives: list[Run]
    duration_s: float  # about how long the base load runs

    def describe(self) -> dict[str, Any]:
        primitives = [{"cause": r.cause, **r.magnitude} for r in self.primitives]
        return {"seed": self.seed, "model": self.model,
                "duration_s": round(self.duration_s, 2), "primitives": primitives}  # fmt: skip


def make_group(seed: int, model: str, causes: list[str]) -> Group:
    """The group of ``seed`` on ``model``: its base load and one run per cause in ``causes``."""
    rng = np.random.default_rng(seed)
    p = PROFILES[model]
    duration = float(rng.uniform(1.0, 2.0))
    num = int(rng.integers(2, 7))
    together = bool(rng.random() < 0.5)
    base = []
    for i in range(num):
        lo, hi = p.base_prompt
        prompt_len = int(np.exp(rng.uniform(np.log(lo), np.log(hi))))
        tokens = max(p.min_tokens, int(duration * rng.uniform(0.5, 1.0) / p.step_s))
        body: dict[str, Any] = {
            "prompt": [int(t) for t in rng.integers(100, 20000, prompt_len)],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": bool(rng.random() < 0.85),
        }  # fmt: skip
        if p.spaced_s:  # one at a time, a few steps apart
            at = i * p.spaced_s + float(rng.uniform(0, 0.5 * p.spaced_s))
        else:
            at = 0.0 if together else float(rng.uniform(0, 0.3 * duration))
        base.append(Ask(i, body, at))
    deployment: list[str] = []
    if "imbalance" in causes:
        deployment = two_engines(rng, base)
    control = Run(None, _copy(base), list(deployment))
    runs = [PRIMITIVES[c](rng, p, _copy(base), duration) for c in causes]
    for r in runs:
        r.flags = [*deployment, *r.flags]  # the primitive's own flags after: they win
    return Group(seed, model, control, runs, duration)


def two_engines(rng: np.random.Generator, base: list[Ask]) -> list[str]:
    """A deployment of two engines, each with room for half the streams (the load rule fits
    them all; one engine alone does not), the prompts sharing their first KV blocks, more than
    half of each (a long system prompt: what prefix affinity keys on): the flags every run of
    the group gets."""
    longest = max(len(a.body["prompt"]) for a in base)
    shared = [int(t) for t in rng.integers(100, 20000, BLOCK * (2 + -(-longest // BLOCK)))]
    for a in base:
        a.body["prompt"] = shared + a.body["prompt"]
        # Within the smallest context of the three models (the tiny one's): a longer one is a
        # 400, refused in the control as in the primitive.
        a.body["max_tokens"] = min(a.body["max_tokens"], CONTEXT - len(a.body["prompt"]))
    return ["--data-parallel-size", "2", "--max-num-seqs", str(-(-len(base) // 2))]


def _copy(asks: list[Ask]) -> list[Ask]:
    return [Ask(a.index, dict(a.body), a.at_s, a.path) for a in asks]


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))


def _some(rng: np.random.Generator, asks: list[Ask], most: int, streams: bool = False) -> list[Ask]:
    pool = [a for a in asks if a.body["stream"] or not streams]
    if not pool:
        pool = asks
        for a in pool:
            a.body["stream"] = True
    k = int(rng.integers(1, min(most, len(pool)) + 1))
    return [pool[i] for i in sorted(rng.choice(len(pool), k, replace=False))]


def _prefill(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    k = int(rng.integers(1, 4))
    lengths = [int(_log_uniform(rng, *p.long_prompt)) for _ in range(k)]
    at = float(rng.uniform(0.2, 0.6) * d)
    for j, n in enumerate(lengths):
        body = {"prompt": [int(t) for t in rng.integers(100, 20000, n)], "max_tokens": 2,
                "temperature": 0, "stream": False}  # fmt: skip
        asks.append(Ask(100 + j, body, at + 0.01 * j, extra=True))
    return Run("prefill", asks, magnitude={"prompts": lengths, "at_s": round(at, 3)})


def _max_num_seqs(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    m = int(rng.integers(1, len(asks)))
    return Run("max_num_seqs", asks, ["--max-num-seqs", str(m)], magnitude={"max_num_seqs": m})


def _kv_blocks(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    # Each request's blocks in every KV group (a window of 512 holds all of these short ones).
    need = [-(-(len(a.body["prompt"]) + a.body["max_tokens"]) // BLOCK) * p.kv_groups
            for a in asks]  # fmt: skip
    lo = max(need) + p.kv_groups
    hi = max(lo + 1, int(0.75 * sum(need)))
    blocks = int(rng.integers(lo, hi))
    return Run("kv_blocks", asks, ["--num-kv-blocks", str(blocks)],
               magnitude={"num_kv_blocks": blocks, "needed": sum(need)})  # fmt: skip


def _token_budget(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    # Room for every stream's decode token, and at most a third of the longest prompt, smaller
    # budgets likelier: a budget the prompts fit in whole holds nothing.
    lo = max(len(asks), 4)
    hi = max(lo + 1, min(33, max(len(a.body["prompt"]) for a in asks) // 3))
    budget = min(int(_log_uniform(rng, lo, hi + 1)), hi)
    return Run("token_budget", asks, ["--max-num-batched-tokens", str(budget)],
               magnitude={"max_num_batched_tokens": budget})  # fmt: skip


def _api_cpu(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    chosen = _some(rng, asks, len(asks))
    numbers = int(_log_uniform(rng, 10_000, 1_000_000))  # up to 7 MB: under the 8 MB limit
    for a in chosen:
        a.body["padding"] = list(range(numbers))  # an unknown field: read, decoded, ignored
    return Run("api_cpu", asks, magnitude={"bodies": len(chosen), "numbers": numbers})


def _grammar(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    chosen = _some(rng, asks, len(asks))
    fields = int(rng.integers(2, 31))
    props: dict[str, Any] = {
        f"field_{i}": {"type": "string", "maxLength": 8} for i in range(fields)
    }
    # The last field never ends within max_tokens: the stream runs as long as its control.
    props["story"] = {"type": "string", "minLength": 20000}
    schema = {"type": "object", "properties": props, "required": list(props),
              "additionalProperties": False}  # fmt: skip
    for a in chosen:
        a.body["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "g", "schema": schema}}  # fmt: skip
    return Run("grammar", asks, magnitude={"rows": len(chosen), "fields": fields})


def _logprobs(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    chosen = _some(rng, asks, len(asks))
    k = int(rng.integers(1, 21))
    for a in chosen:
        a.body["logprobs"] = k
    return Run("logprobs", asks, magnitude={"rows": len(chosen), "top": k})


def _penalties(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    chosen = _some(rng, asks, len(asks))
    for a in chosen:
        a.body.update(temperature=float(rng.uniform(0.5, 1.2)), top_p=0.9, top_k=50, seed=1,
                      presence_penalty=0.5, frequency_penalty=0.5,
                      repetition_penalty=1.1)  # fmt: skip
    return Run("penalties", asks, magnitude={"rows": len(chosen)})


def _slow_reader(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    chosen = _some(rng, asks, 2, streams=True)
    pauses = []
    for a in chosen:
        a.pause_after = int(rng.integers(3, max(4, a.body["max_tokens"] // 3)))
        a.pause_s = _log_uniform(rng, 0.03, 3.0)
        pauses.append(round(a.pause_s, 3))
    return Run("slow_reader", asks, magnitude={"pauses_s": pauses})


def _cancel(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    chosen = _some(rng, asks, 3, streams=True)
    for a in chosen:
        a.cancel_after = int(rng.integers(1, max(2, a.body["max_tokens"] // 2)))
    return Run("cancel", asks, magnitude={"cancelled": len(chosen)})


def _crash(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    at = float(rng.uniform(0.1, 0.7) * d)
    return Run("crash", asks, ["--max-queue-wait", "60"], actions=[Action("kill_core", at)],
               magnitude={"at_s": round(at, 3)})  # fmt: skip


def _hang(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    at = float(rng.uniform(0.1, 0.7) * d)
    # Most stop the core for less than the hang timeout's kill (twice 2 s); some past it, so
    # the supervisor kills and restarts it.
    stop = _log_uniform(rng, 0.02, 1.5) if rng.random() < 0.75 else float(rng.uniform(4.5, 6))
    flags = ["--engine-hang-timeout", "2", "--max-queue-wait", "60"]
    return Run("hang", asks, flags, actions=[Action("stop_core", at, stop)],
               magnitude={"at_s": round(at, 3), "stopped_s": round(stop, 3)})  # fmt: skip


def _gc(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    process = "api" if rng.random() < 0.5 else "core"
    seconds = _log_uniform(rng, 0.01, 0.4)
    at = float(rng.uniform(0.1, 0.7) * d)
    magnitude = {"process": process, "seconds": round(seconds, 4), "at_s": round(at, 3)}
    return Run("gc", asks, env={"LUMEN_DEBUG_GC": f"{process}={seconds:.4f}"},
               actions=[Action(f"gc_{process}", at)], magnitude=magnitude)  # fmt: skip


def _imbalance(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    # Prefix affinity with no bound: every request goes where the shared prefix went first,
    # and those past its room queue there while the other engine has room.
    bound = 1000
    return Run("imbalance", asks, ["--data-parallel-prefix-affinity", str(bound)],
               magnitude={"prefix_affinity": bound})  # fmt: skip


def _speculation(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    # Drafts the model refuses: a random draft model where the model has SmolLM2's tokenizer,
    # prompt lookup of one token on Gemma 3 (the base prompts are random token ids). Every step
    # may speculate (disable_by_batch_size over the load's streams).
    k = int(rng.integers(3, 9))
    if p.name == "gemma3":
        spec: dict[str, Any] = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    else:
        spec = {"method": "draft_model", "model": RANDOM_DRAFT}
    spec |= {"num_speculative_tokens": k, "disable_by_batch_size": 64}
    return Run("speculation", asks, ["--speculative-config", json.dumps(spec)],
               magnitude={"method": spec["method"], "k": k})  # fmt: skip


def _lora_slots(rng: np.random.Generator, p: Profile, asks: list[Ask], d: float) -> Run:
    # The streams spread over 2 to 4 adapters with one slot (--max-loras 1): an adapter's
    # requests wait while another's run.
    n = int(rng.integers(2, min(4, len(asks)) + 1))
    names = [f"lora{i}" for i in range(n)]
    for i, a in enumerate(rng.permutation(len(asks))):
        asks[int(a)].body["model"] = names[i % n]
    modules = [f"{name}={LORA_ADAPTERS}/{name}" for name in names]
    return Run("lora_slots", asks, ["--enable-lora", "--max-loras", "1", "--lora-modules",
                                    *modules], magnitude={"adapters": n})  # fmt: skip


PRIMITIVES: dict[str, Callable[[np.random.Generator, Profile, list[Ask], float], Run]] = {
    "prefill": _prefill, "max_num_seqs": _max_num_seqs, "kv_blocks": _kv_blocks,
    "token_budget": _token_budget, "api_cpu": _api_cpu, "grammar": _grammar,
    "logprobs": _logprobs, "penalties": _penalties, "slow_reader": _slow_reader,
    "cancel": _cancel, "crash": _crash, "hang": _hang, "gc": _gc, "imbalance": _imbalance,
    "speculation": _speculation, "lora_slots": _lora_slots,
}  # fmt: skip
assert tuple(PRIMITIVES) == CAUSES
