"""GGUF files written in the tests: a tiny random Llama with a real tokenizer, and broken ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
VOCAB = 1024
# A file of five formats, as llama.cpp's mixes are (--quantization gguf's tests)
MIXED_TYPES = {"attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "Q4_0", "attn_output": "Q4_1",
               "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0"}  # fmt: skip


def write_tiny_llama_gguf(
    out: Path, tokenizer_from: Path, *, seed: int = 0, layers: str = "Q8_0",
    types: dict[str, str] | None = None, head: str = "F16",
) -> Path:  # fmt: skip
    """A 2-layer Llama (hidden 64) as llama.cpp lays it out: norms and the embedding in F32,
    the layers' products quantized to ``layers`` (Q8_0, Q4_0, Q4_1 or Q5_0: what the gguf
    package quantizes), or each to ``types``' format by its name (``attn_q``, ``ffn_down``,
    ...), an untied output head in ``head`` (F16, or one of those formats); the first 1,024
    tokens of the SmolLM2 tokenizer (BPE) in its metadata. transformers reads it back as it
    reads any GGUF file."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    tok = json.loads((tokenizer_from / "tokenizer.json").read_text())
    # The first VOCAB tokens and the merges among them: still a whole BPE tokenizer, and
    # 48x fewer strings for every GGUF reader to parse (the full 49,152 took transformers
    # 5 s per read).
    vocab = {text: i for text, i in tok["model"]["vocab"].items() if i < VOCAB}
    tokens = [""] * VOCAB
    for text, i in vocab.items():
        tokens[i] = text
    special = {a["id"] for a in tok["added_tokens"] if a.get("special")}
    pairs = (m.split(" ", 1) if isinstance(m, str) else m for m in tok["model"]["merges"])
    merges = [f"{a} {b}" for a, b in pairs if a in vocab and b in vocab and a + b in vocab]

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(out.stem)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(rows: int, cols: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def q8(name: str, data: np.ndarray) -> None:
        kind = Q[(types or {}).get(name.split(".")[2], layers)]
        w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    w.add_tensor("token_embd.weight", matrix(len(tokens), HIDDEN))
    w.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    if head == "F16":
        w.add_tensor("output.weight", matrix(len(tokens), HIDDEN).astype(np.float16))
    else:
        blocks = gguf.quants.quantize(matrix(len(tokens), HIDDEN), Q[head])
        w.add_tensor("output.weight", blocks, raw_dtype=Q[head])
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
        q8(p + "attn_q.weight", matrix(HEADS * head_dim, HIDDEN))
        q8(p + "attn_k.weight", matrix(KV_HEADS * head_dim, HIDDEN))
        q8(p + "attn_v.weight", matrix(KV_HEADS * head_dim, HIDDEN))
        q8(p + "attn_output.weight", matrix(HIDDEN, HEADS * head_dim))
        q8(p + "ffn_gate.weight", matrix(INTER, HIDDEN))
        q8(p + "ffn_up.weight", matrix(INTER, HIDDEN))
        q8(p + "ffn_down.weight", matrix(HIDDEN, INTER))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_odd_gguf(out: Path, *, arch: str = "llama", qtype: str = "F32") -> Path:
    """A GGUF file of one tensor: with an architecture or a tensor type Lumen cannot read."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    w = gguf.GGUFWriter(str(out), arch)
    kind = Q[qtype]
    if kind == Q.F32:
        w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:  # raw blocks of the type: 32 values each
        block, size = gguf.GGML_QUANT_SIZES[kind]
        data = np.zeros((4, 32 // block * size), dtype=np.uint8)
        w.add_tensor("token_embd.weight", data, raw_dtype=kind)  # the shape in bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def q4_k_blocks(rows: int, cols: int, *, seed: int = 0) -> np.ndarray:
    """Random Q4_K blocks [rows, cols / 256 * 144] (the gguf package writes none): fp16 d and
    dmin, packed 6-bit scales and minimums, codes."""
    return random_blocks("Q4_K", rows, cols, seed=seed)


# Where a K format's fp16 scales sit in its block (the other bytes are codes and 6- or 8-bit
# scales: any byte is one).
_K_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, *, seed: int = 0) -> np.ndarray:
    """A [rows, cols] weight's blocks [rows, bytes] of the GGUF format ``kind``: a random
    weight quantized by the gguf package (Q4_0, Q4_1, Q5_0, Q8_0), or random bytes with small
    fp16 scales for the K formats, which it does not quantize."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    if kind not in _K_HALVES:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q[kind])
    per, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    blocks = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for start in _K_HALVES[kind]:
        halves = rng.uniform(1e-3, 1e-2, (rows, cols // per)).astype(np.float16)
        blocks[..., start : start + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


TINY_PROMPTS = [[1, *range(40, 40 + n)] for n in (3, 20, 50)]


def greedy_tokens(gguf: Path, quantization: str, max_tokens: int = 8) -> list[list[int]]:
    """The tiny file served offline under ``quantization``: TINY_PROMPTS' greedy tokens."""
    from engine import LLM, SamplingParams

    llm = LLM(str(gguf), num_kv_blocks=64, quantization=quantization)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]  # fmt: skip
    finally:
        llm.shutdown()
