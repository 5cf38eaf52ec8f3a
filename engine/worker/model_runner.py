"""ModelRunner: turns a SchedulerOutput into tensors, runs one forward, samples."""

from __future__ import annotations

import time

import numpy as np
import torch

from engine import envs
from engine.kv_layout import KVLayout
from engine.lora import LoraSettings
from engine.messages import Logprobs
from engine.model_config import ModelConfig
from engine.spec_config import SpeculativeConfig
from engine.worker import cpu_threads, heap, kv_quant, spec_decode
from engine.worker.allocation import check_fits_in_memory, materialize, zeros
from engine.worker.attention import (
    AttentionMetadata,
    PrefillChunk,
    additive_mask,
    chunk_with_context,
    windowed,
)
from engine.worker.cpu_kernels import CpuKernels
from engine.worker.decode_cache import DecodeCache
from engine.worker.draft import DraftProposer
from engine.worker.layers import Shard
from engine.worker.llama import LlamaForCausalLM
from engine.worker.lora import LoraAdapters
from engine.worker.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.worker.ngram import NgramProposer
from engine.worker.rotary import Rotary
from engine.worker.sampler import Sampler, SamplingRow, plain_greedy
from engine.worker.step_inputs import Rows, StepInputs

# The decode mirror's least budget (decode_cache.py), whatever the KV pool's size.
MIRROR_FLOOR_BYTES = 256 * 2**20


class ModelRunner:
    """Owns the weights and the KV cache tensors on one device; executes what it is told."""

    def __init__(
        self,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        block_size: int,
        seed: int = 0,
        shard: Shard | None = None,
        kv_dtype: torch.dtype | None = None,
        quantization: str | None = None,
        kv_layout: KVLayout | None = None,
        speculative: SpeculativeConfig | None = None,
        lora: LoraSettings | None = None,
    ) -> None:
        self.cfg = model_config
        self.lora_settings = lora
        self.lora: LoraAdapters | None = None  # --enable-lora: the adapters, on every rank
        # Which layers share KV blocks (engine/kv_layout.py): the core's own layout.
        self.layout = kv_layout or KVLayout.single(model_config.num_layers)
        self.shard = shard or Shard()
        # Every rank runs the forward (for the collectives); only rank 0 samples.
        self.is_driver = self.shard.rank == 0
        # Drafts for the next step (--speculative-config), proposed by the driver.
        self.proposer: NgramProposer | DraftProposer | None = None
        self.speculative = speculative if self.is_driver else None
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the paged cache's and the mirror's
        self.quantization = quantization
        self.block_size = block_size
        self.model: LlamaForCausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_caches: list[DecodeCache] = []  # one per KV group (CPU only)
        # Rows verifying drafts run as decode rows (set with the KV cache: the mirror's native
        # attention, no sliding window).
        self.verify_as_decode = False
        self.rotary = Rotary(model_config, max_model_len, device)
        self.max_model_len = max_model_len
        self.sampler = Sampler(device, seed)
        self.rows: dict[str, SamplingRow] = {}
        # Set where this runner's process is the engine's own (not a user's): then it may
        # choose the process's CPU threads.
        self.owns_process = False
        # The CPU kernels chosen at load (autotune), which the model reads; kept across a
        # sleep and wake-up, so they are chosen once.
        self.kernels = CpuKernels()

    def load_model(self) -> None:
        with torch.device("meta"):
            model = LlamaForCausalLM(self.cfg, self.shard, self.kernels)
        model = materialize(model, self.device, self.dtype)
        model.load_weights(self.cfg.path)
        if self.quantization is not None:
            model.quantize_weights(self.quantization)
        spec = self.speculative
        if spec is not None and spec.method == "ngram":
            assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec is not None:
            cfg, layout = DraftProposer.check(spec, self.layout)
            draft = ModelRunner(cfg, self.device, self.dtype, self.max_model_len,
                                self.block_size, kv_dtype=self.kv_dtype,
                                quantization=spec.quantization, kv_layout=layout)  # fmt: skip
            draft.load_model()
            shared = DraftProposer.shares_pool(spec, self.cfg, self.shard.size)
            self.proposer = DraftProposer(draft, shared)
        if (lora := self.lora_settings) is not None:
            self.lora = LoraAdapters(self.cfg, self.shard, self.dtype, self.device,
                                     lora.max_cpu_loras, lora.max_rank)  # fmt: skip
            model.use_lora(self.lora.batch)
        if self.device.type == "cpu":
            model.pack_weights()
            if self.is_driver:  # only the driver samples: no copy or timing on other ranks
                model.plan_greedy_head()
        self.model = model.eval()

    def block_bytes(self) -> int:
        """Bytes of one block on this rank: ``block_size`` tokens of one KV group's layers,
        of this rank's share of the KV heads."""
        per_layer = self.cfg.kv_bytes_per_token(self.kv_dtype) // self.cfg.num_layers
        own = self.block_size * per_layer * self.layout.group_size // self.shard.size
        # A draft model's KV lies in a pool of as many blocks (engine/worker/draft.py).
        return own + (self.proposer.block_bytes() if isinstance(self.proposer, DraftProposer)
                      else 0)  # fmt: skip

    def init_kv_cache(
        self, num_blocks: int, shared: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> None:
        """The paged KV pool of ``num_blocks`` blocks (``shared``: another runner's, of the
        same shape: a self-draft's, engine/worker/draft.py), and the CPU decode mirrors."""
        num_kv_heads = self.cfg.num_kv_heads // self.shard.size
        # An 8-bit cache's rows hold their codes and a scale (kv_quant.py).
        row = kv_quant.row_width(self.cfg.head_dim, self.kv_dtype)
        stored = kv_quant.storage_dtype(self.kv_dtype)
        shape = (num_blocks, self.block_size, num_kv_heads, row)
        if shared is not None:
            self.kv_caches = shared
        else:
            if self.device.type == "cpu":
                check_fits_in_memory(num_blocks * self.block_bytes() * self.shard.size)
            # Zeroed: padded reads are masked, but a masked NaN would still poison P @ V. One
            # pair per place in a KV group: layer l uses its group's blocks of pair
            # layer_slot[l].
            pairs = [
                (zeros(shape, stored, self.device), zeros(shape, stored, self.device))
                for _ in range(self.layout.group_size)
            ]
            self.kv_caches = [pairs[j] for j in self.layout.layer_slot]

        if self.device.type == "cpu":
            # On CPU, gathering blocks for decode costs as much as attention
            # itself; a contiguous mirror of decoding requests avoids it (on CUDA the
            # gather is cheap). A group with a window mirrors only its window (a ring).
            group = self.cfg.num_heads // self.cfg.num_kv_heads
            choice = self.kernels.choose_attention(group, self.cfg.head_dim, stored)
            layout = self.layout
            # Each group's mirror: up to the pool's size, and never under MIRROR_FLOOR_BYTES.
            # Its slots are rectangles (every slot as wide as the longest context), so a small
            # pool's mirror, bounded by the pool alone, ran out at a few rows: 197 blocks of
            # the tiny model sent 4-6 row steps to the gather path, at twice their time.
            budget = max(num_blocks * self.block_bytes(), MIRROR_FLOOR_BYTES)
            self.decode_caches = [
                DecodeCache(
                    self.cfg.num_layers, num_kv_heads, self.cfg.head_dim, self.block_size,
                    self.dtype, self.device, max_bytes=budget, kv_dtype=stored,
                    native=choice.kernel, window=window or self.cfg.sliding_window,
                    layers=[i for i, gi in enumerate(layout.layer_group) if gi == g],
                    ring=bool(window),
                )
                for g, window in enumerate(layout.windows)
            ]  # fmt: skip

        self.verify_as_decode = (
            bool(self.decode_caches)
            and all(c.native is not None and not c.window and not c.ring
                    for c in self.decode_caches)
            and not self.cfg.sliding_window
            and envs.LUMEN_VERIFY_AS_DECODE.get() != "off"
        )  # fmt: skip
        if isinstance(self.proposer, DraftProposer):
            self.proposer.init_kv_cache(num_blocks, self.kv_caches)
        if self.device.type == "cpu":
            if self.owns_process:  # before the threads' timing, which steps the model
                heap.fix_mmap_threshold()
            self.kernels.choose_threads(self._time_step, self.owns_process, self._shape())

    def _shape(self) -> dict[str, object]:
        """What a step's time depends on, beside the machine: the thread choice's cache key."""
        cfg = self.cfg
        return {
            "layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab": cfg.vocab_size,
            "intermediate": cfg.intermediate_size, "tp": self.shard.size,
            "dtype": str(self.dtype), "kv_dtype": str(self.kv_dtype),
            "quantization": self.quantization, "driver": self.is_driver,
        }  # fmt: skip

    @torch.inference_mode()
    def _time_step(self) -> None:
        """One forward of a ``cpu_threads.ROWS``-token chunk into the first blocks after
        block 0 (free before any request; block 0 may be the null block, never written),
        sampling every row, as a decode batch does."""
        assert self.model is not None
        first = self.block_size if len(self.kv_caches[0][0]) > 1 else 0
        rows = min(cpu_threads.ROWS, len(self.kv_caches[0][0]) * self.block_size - first)
        chunk = PrefillChunk(0, rows, 0, None, None)
        slots = torch.arange(first, first + rows, device=self.device)
        meta = AttentionMetadata(slots, 0, None, None, [chunk])
        ids = torch.arange(1, rows + 1, device=self.device)
        positions = torch.arange(rows, device=self.device)
        hidden = self.model(ids, positions, self.rotary, self.kv_caches, meta, positions, False)
        self.model.greedy_tokens(hidden)

    def release_kv_cache(self) -> None:
        self.kv_caches = []
        self.decode_caches = []
        if isinstance(self.proposer, DraftProposer):
            self.proposer.release_kv_cache()

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in sched.finished_req_ids:
            self.rows.pop(req_id, None)
        if self.proposer is not None:
            self.proposer.drop(sched.finished_req_ids, sched.preempted_req_ids)
        for cache in self.decode_caches:
            cache.drop(sched.finished_req_ids + sched.preempted_req_ids)
        if self.lora is not None:
            self.lora.drop(sched.finished_req_ids)
            self.lora.add(sched.new_requests)
        if self.is_driver:
            for new in sched.new_requests:
                self._add_request(new)
        if not sched.req_ids:
            return ModelRunnerOutput([], [])
        inputs = self._prepare_inputs(sched)
        if self.lora is not None:
            self.lora.set_batch(sched, inputs.order)
        assert self.model is not None
        hidden = self.model(
            inputs.input_ids,
            inputs.positions,
            self.rotary,
            self.kv_caches,
            inputs.meta,
            inputs.logits_indices,
            head=False,
        )
        if not self.is_driver:  # the head is replicated: only the driver samples
            return ModelRunnerOutput([], [])
        if sched.spec_token_ids and not sched.spec_catch_up:
            out = self._verify(sched, inputs.sample_req_ids, hidden)
        else:
            out = self._sample(sched, inputs.sample_req_ids, hidden)
        if self.proposer is not None and sched.num_spec_tokens:
            start = time.perf_counter_ns()
            req_ids = out.req_ids
            if sched.no_drafts:
                skip = set(sched.no_drafts)
                req_ids = [r for r in req_ids if r not in skip]
            out.draft_token_ids = self.proposer.propose(
                req_ids, self.rows, sched.num_spec_tokens, sched
            )
            out.propose_ns = time.perf_counter_ns() - start
        return out

    def _sample(
        self, sched: SchedulerOutput, sample_req_ids: list[str], hidden: torch.Tensor
    ) -> ModelRunnerOutput:
        """One token for each row that samples (no drafts to verify this step)."""
        assert self.model is not None
        rows = [self.rows[r] for r in sample_req_ids]
        if rows and not sched.grammar_req_ids and plain_greedy(rows):
            # Only each row's best token is needed: no logits (cpu_greedy_head).
            sampled = self.model.greedy_tokens(hidden).tolist()
            for row, token in zip(rows, sampled):
                row.output_token_ids.append(token)
            return ModelRunnerOutput(sample_req_ids, sampled)
        grammar = _grammar(sched, sample_req_ids)
        sampled, logprobs = self.sampler(self.model.logits(hidden), rows, grammar)
        for row, token in zip(rows, sampled):
            row.output_token_ids.append(token)
        return self._output(sample_req_ids, rows, sampled, logprobs)

    def _verify(
        self, sched: SchedulerOutput, sample_req_ids: list[str], hidden: torch.Tensor
    ) -> ModelRunnerOutput:
        """The tokens of each row that samples: a row with drafts keeps those the target
        agrees with (engine/worker/spec_decode.py) and one more of its own."""
        assert self.model is not None
        rows = [self.rows[r] for r in sample_req_ids]
        drafts = [sched.spec_token_ids.get(r, []) for r in sample_req_ids]
        q = None  # where a draft model drew the drafts from its distribution: that
        if isinstance(self.proposer, DraftProposer):
            q = [self.proposer.draft_probs(r, len(d)) for r, d in zip(sample_req_ids, drafts)]
        tokens, logprobs = spec_decode.kept_tokens(
            self.model, self.sampler, hidden, rows, drafts, _grammar(sched, sample_req_ids), q
        )
        for row, new in zip(rows, tokens):
            row.output_token_ids.extend(new)
        out = self._output(sample_req_ids, rows, [new[0] for new in tokens], logprobs)
        out.spec_token_ids = {r: new[1:] for r, new in zip(sample_req_ids, tokens) if len(new) > 1}
        return out

    def _output(
        self, req_ids: list[str], rows: list[SamplingRow], first: list[int],
        logprobs: list[Logprobs | None],
    ) -> ModelRunnerOutput:  # fmt: skip
        """What the sampler's path returns: the rows' first new tokens, their logprobs, and
        the sampler's share of the step."""
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        return ModelRunnerOutput(
            req_ids,
            first,
            {r: lp for r, lp in zip(req_ids, logprobs) if lp is not None},
            sample_ns=self.sampler.sample_ns,
            logprobs_ns=self.sampler.logprobs_ns,
            num_logprobs_rows=len(asked),
            max_logprobs=max(asked, default=0),
        )

    def _add_request(self, new: NewRequestData) -> None:
        seed = new.sampling_params.seed
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed % (1 << 64))
        self.rows[new.request_id] = SamplingRow(
            new.sampling_params, generator, new.prompt_token_ids, [], new.eos_token_ids
        )
        if self.proposer is not None:
            self.proposer.add(new.request_id, new.prompt_token_ids)

    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        # Decode rows (a single token after a full prefix) go first, batched. A row verifying
        # drafts runs as a decode row a token where the mirror's native attention allows it
        # (rows of one slot at consecutive positions), else as a prefill chunk.
        spec = sched.spec_token_ids if self.verify_as_decode else {}

        def prefill(i: int) -> bool:
            return not ((len(sched.token_ids[i]) == 1 and sched.num_computed_tokens[i] > 0)
                        or sched.req_ids[i] in spec)  # fmt: skip

        order = sorted(range(len(sched.req_ids)), key=prefill)
        if self.lora is not None and self.lora.of:  # an adapter's rows side by side: a slice
            adapter = self.lora.key
            order.sort(key=lambda i: (prefill(i), adapter(sched.req_ids[i])))
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        logits_indices: list[int] = []
        sample_req_ids: list[str] = []
        decode_rows: list[int] = []  # scheduled row of each decode row
        decode_starts: list[int] = []
        decode_req_ids: list[str] = []
        prefill_rows: list[tuple[int, int, int, int]] = []  # (row, first flat row, tokens, start)
        for i in order:
            ids, start = sched.token_ids[i], sched.num_computed_tokens[i]
            n = len(ids)
            row0 = len(token_ids)
            token_ids.extend(ids)
            if n == 1 and start > 0:
                decode_rows.append(i)
                decode_starts.append(start)
                decode_req_ids.append(sched.req_ids[i])
                if sched.sample[i] and self.is_driver:
                    logits_indices.append(row0)
                    sample_req_ids.append(sched.req_ids[i])
                continue
            if spec and sched.req_ids[i] in spec:
                rid = sched.req_ids[i]
                decode_rows.extend([i] * n)
                decode_starts.extend(range(start, start + n))
                decode_req_ids.extend([rid] * n)
                if self.is_driver:
                    if sched.spec_catch_up:  # known tokens: only the last one's next
                        logits_indices.append(row0 + n - 1)
                    else:
                        logits_indices.extend(range(row0, row0 + n))
                    sample_req_ids.append(rid)
                continue
            positions.append(np.arange(start, start + n))
            prefill_rows.append((i, row0, n, start))
            if sched.sample[i] and self.is_driver:
                # A row that verifies drafts samples at each of them and after the last.
                first = row0 + n - 1
                if not sched.spec_catch_up:
                    first -= len(sched.spec_token_ids.get(sched.req_ids[i], ()))
                logits_indices.extend(range(first, row0 + n))
                sample_req_ids.append(sched.req_ids[i])
        dev = self.device
        positions.insert(0, np.array(decode_starts, dtype=np.int64))
        # (Its masks: the groups' prefill masks are the same for the same chunk, built once a
        # step: a 2,048-token chunk over an 8K context is a 64 MB mask.)
        rows = Rows(decode_rows, decode_starts, decode_req_ids, prefill_rows)
        layout = self.layout
        metas = [self._group_meta(sched, g, rows) for g in range(layout.num_groups)]
        meta = metas[0]
        if len(metas) > 1:  # each layer reads its own group's blocks
            meta.by_layer = [metas[g] for g in layout.layer_group]
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sample_req_ids=sample_req_ids,
            order=order,
        )

    def _group_meta(self, sched: SchedulerOutput, group: int, rows: Rows) -> AttentionMetadata:
        """The step's attention metadata for the layers of one KV group: its slots, its
        block tables, and (a group with a window) masks that hide keys behind it."""
        if group and sched.group_block_tables:
            tables = [t[group - 1] for t in sched.group_block_tables]
        else:  # the first group's, or a step (the warm-up's) that gives every group one table
            tables = sched.block_tables
        bs, dev = self.block_size, self.device
        decode_tables = [tables[i] for i in rows.decode]
        # Decode rows in plain ints (numpy costs microseconds per call, per row); prefill rows
        # as arrays after them.
        slots: list[np.ndarray] = [
            np.array(
                [t[p // bs] * bs + p % bs for t, p in zip(decode_tables, rows.decode_starts)],
                dtype=np.int64,
            )
        ]
        # A group of sliding layers masks its own; one group of both kinds (no hybrid
        # layout) gives its local layers a windowed view.
        own = self.layout.windows[group]
        prefills: list[PrefillChunk] = []
        for i, row0, n, start in rows.prefill:
            pos = np.arange(start, start + n)
            slots.append(np.asarray(tables[i], dtype=np.int64)[pos // bs] * bs + pos % bs)
            if start == 0:
                prefills.append(PrefillChunk(row0, row0 + n, 0, None, None))
            else:
                # A chunk past its group's own window gets the window's mask below: no
                # whole-context mask for it (at 8K context, 64 MB a 2,048-token chunk).
                whole = not own or start + n <= own
                prefills.append(chunk_with_context(
                    row0, n, start, tables[i], rows.masks if whole else None, bs, self.dtype,
                    dev,
                ))  # fmt: skip
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_decodes=len(decode_tables),
            decode_block_tables=None,
            decode_mask=None,
            prefills=prefills,
        )
        starts = rows.decode_starts
        if decode_tables and self.decode_caches:
            cache = self.decode_caches[group]
            meta.decode_plan = cache.plan(rows.decode_req_ids, starts, decode_tables)
        if decode_tables and meta.decode_plan is None:
            max_blocks = max(len(t) for t in decode_tables)
            padded = np.zeros((len(decode_tables), max_blocks), dtype=np.int64)
            for j, t in enumerate(decode_tables):
                padded[j, : len(t)] = t
            lens = torch.tensor(starts, device=dev) + 1
            meta.decode_block_tables = torch.from_numpy(padded).to(dev)
            visible = torch.arange(max_blocks * bs, device=dev).unsqueeze(0) < lens.unsqueeze(1)
            meta.decode_mask = additive_mask(visible, self.dtype).view(len(decode_tables), 1, 1, -1)
        window = own or self.cfg.sliding_window
        # A row's context, itself included: past the window, the window's layers mask.
        if window and (
            max(starts, default=-1) + 1 > window
            or any(p.num_computed + p.end - p.start > window for p in prefills)
        ):
            lens = torch.tensor(starts, dtype=torch.long, device=dev) + 1
            local = windowed(meta, window, lens, self.dtype, rows.masks, self.block_size)
            if own:
                return local
            meta.local = local
        return meta


def _grammar(
    sched: SchedulerOutput, sample_req_ids: list[str]
) -> tuple[list[str], list[str], bytes] | None:
    """The sampler's grammar argument: the rows, those under a grammar and their masks."""
    if not sched.grammar_req_ids:
        return None
    return sample_req_ids, sched.grammar_req_ids, sched.grammar_bitmask
