"""AsyncLLM: streamed deltas, disconnects, stalled readers and a dead engine."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.async_llm import AsyncLLM, StreamStalledError
from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineRestartingError
from engine.output_stream import OutputStream
from engine.outputs import CompletionOutput, RequestOutput
from tests.helpers.procs import wait_no_children

PROMPTS = [{"prompt_token_ids": [40 + i, 1200, 77 * (i + 1), 9, 31]} for i in range(6)]


def _config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), num_kv_blocks=128)


async def _drain(llm: AsyncLLM, prompt, params: SamplingParams) -> tuple[str, list[int], str]:
    text, tokens, finish = "", [], ""
    async for out in llm.generate(prompt, params):
        for c in out.outputs:
            text += c.text
            tokens += c.token_ids
            finish = c.finish_reason or finish
    return text, tokens, finish


def test_streamed_deltas_add_up_to_the_offline_result(tiny_model_path: Path) -> None:
    """Deltas add up to the offline result, stop strings included, at --stream-interval 4
    (vLLM's): the first token at once, then deltas of 4 tokens, the last at once with what is
    left. (Every server test streams at the default interval, 1: a delta a token.)"""
    greedy = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
    offline = LLM(str(tiny_model_path), num_kv_blocks=64)
    ref = offline.generate(PROMPTS, greedy, use_tqdm=False)
    cut = ref[0].outputs[0].text[10:13]
    stopped = offline.generate(PROMPTS[:1], greedy.clone(stop=[cut]), use_tqdm=False)[0]

    async def sizes(llm: AsyncLLM, prompt, params: SamplingParams) -> list[list[int]]:
        got: list[list[int]] = [[] for _ in range(params.n)]
        async for out in llm.generate(prompt, params):
            for c in out.outputs:
                got[c.index].append(len(c.token_ids))
        return got

    async def main() -> None:
        llm = AsyncLLM(EngineConfig(model=str(tiny_model_path), num_kv_blocks=128,
                                    stream_interval=4))  # fmt: skip
        try:
            got = await asyncio.gather(*(_drain(llm, p, greedy) for p in PROMPTS))
            for (text, tokens, finish), r in zip(got, ref):
                assert (text, tokens, finish) == (
                    r.outputs[0].text,
                    r.outputs[0].token_ids,
                    "length",
                )
            # A reader that falls behind gets deltas merged (4 + 4 as one 8): cut only after
            # tokens 1, 5 and 9 then, and at the end.
            [one] = await sizes(llm, PROMPTS[0], greedy)
            cuts = list(itertools.accumulate(one))
            assert cuts[-1] == 11 and set(cuts[:-1]) <= {1, 5, 9} and cuts[0] == 1, one
            # n = 2: a delta goes when either sample has 4 unsent tokens (or its first), and
            # takes both samples' tokens.
            for got in await sizes(llm, PROMPTS[0], greedy.clone(n=2, temperature=1.0)):
                assert sum(got) == 11 and got[0] == 1 and len(got) <= 6, got
            # A stop string: the stream never shows text past the cut, and ends at once, held
            # tokens and all.
            text, _, finish = await _drain(llm, PROMPTS[0], greedy.clone(stop=[cut]))
            assert (text, finish) == (stopped.outputs[0].text, "stop")
        finally:
            await llm.shutdown()

    asyncio.run(main())
    assert wait_no_children() == []


def test_leaving_a_stream_aborts_the_request(tiny_model_path: Path) -> None:
    async def main() -> None:
        llm = AsyncLLM(_config(tiny_model_path))
        try:
            # Long enough to be still running at the cancel on the fastest CPU (500 tokens of the
            # tiny model took under 0.3 s on a Zen 5).
            params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            gen = llm.generate(PROMPTS[0], params)
            await gen.__anext__()
            await gen.__anext__()
            await gen.aclose()  # what a disconnecting HTTP client does
            task = asyncio.create_task(_drain(llm, PROMPTS[1], params))
            await asyncio.sleep(0.1)
            task.cancel()  # a cancelled handler
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                stats = await llm.get_stats()
                if (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0):
                    break
                await asyncio.sleep(0.05)
            assert (stats.num_running, stats.num_kv_blocks_used) == (0, 0)
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_a_request_id_in_use_is_refused_and_the_first_request_loses_nothing(
    tiny_model_path: Path,
) -> None:
    async def main() -> None:
        llm = AsyncLLM(_config(tiny_model_path))
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
            first = llm.generate(PROMPTS[0], params, request_id="req")
            outs = [await first.__anext__()]
            # The id itself, and the id its second sample runs under in the core ("req-1").
            for taken in ("req", "req-1"):
                with pytest.raises(ValueError, match="already in use"):
                    async for _ in llm.generate(PROMPTS[1], SamplingParams(max_tokens=2),
                                                request_id=taken):  # fmt: skip
                        pass
            outs += [o async for o in first]
            tokens = {c.index: 0 for o in outs for c in o.outputs}
            for o in outs:
                for c in o.outputs:
                    tokens[c.index] += len(c.token_ids)
            assert tokens == {0: 12, 1: 12}
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_direct_delivery_keeps_every_output_in_order(
    tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader's direct delivery (what the server's streams use) is offered an output only
    while the reader waits with nothing pending: what it takes and what the reader is yielded
    add up to the whole stream, in order, whether it takes, declines or fails."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def run(llm: AsyncLLM, policy) -> tuple[str, list[int], int, int]:  # type: ignore[no-untyped-def]
        text, tokens, calls, busy = [""], [], [0, 0], [False]  # calls: offered, yielded

        def direct(out) -> bool:  # type: ignore[no-untyped-def]
            assert not busy[0], "offered while the reader holds an output it has not written"
            assert not out.finished
            calls[0] += 1
            if not policy(calls[0]):
                return False
            for c in out.outputs:
                text[0] += c.text
                tokens.extend(c.token_ids)
            return True

        prepared = llm.prepare(PROMPTS[0], greedy)
        async for out in llm.generate_prepared(prepared, direct=direct):
            busy[0] = True
            calls[1] += 1
            for c in out.outputs:
                text[0] += c.text
                tokens.extend(c.token_ids)
            await asyncio.sleep(0.02 if calls[1] % 2 else 0)  # a slow write now and then
            busy[0] = False
        return text[0], tokens, calls[0], calls[1]

    def planted(call: int) -> bool:
        if call == 3:
            raise RuntimeError("planted")
        return True

    async def main() -> None:
        llm = AsyncLLM(_config(tiny_model_path))
        try:
            ref, ref_tokens, _ = await _drain(llm, PROMPTS[0], greedy)
            for name, policy in (("always", lambda call: True), ("every third declined",
                                 lambda call: call % 3 != 0), ("failing", planted)):  # fmt: skip
                text, tokens, offered, yielded = await run(llm, policy)
                print(f"{name}: offered {offered} outputs, yielded {yielded}")
                assert (text, tokens) == (ref, ref_tokens), name
                assert offered >= 3 and yielded >= 1, name
            assert "direct delivery of" in caplog.text  # the planted failure, logged
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_direct_delivery_waits_for_what_the_reader_has_not_taken() -> None:
    """Two outputs in a row before the reader runs: the second is not offered while the first
    waits for the reader, so it cannot overtake it."""

    def output(text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [], [CompletionOutput(0, text, [1])], finished=finished)

    async def main() -> None:
        offered: list[RequestOutput] = []
        stream = OutputStream(lambda out: offered.append(out) is None and len(offered) > 1)
        reader = asyncio.create_task(stream.get())
        await asyncio.sleep(0)  # the reader waits
        first, second = output("a"), output("b")
        assert not stream.deliver_directly(first)  # offered, declined
        stream.put(first)
        assert not stream.deliver_directly(second)  # not offered: "a" is not taken yet
        stream.put(second)
        assert (await reader).outputs[0].text == "ab"
        reader = asyncio.create_task(stream.get())
        await asyncio.sleep(0)
        third = output("c")
        assert stream.deliver_directly(third)  # offered, taken
        assert not stream.deliver_directly(output("d", finished=True))  # the last: never
        assert len(offered) == 2 and offered[0] is first and offered[1] is third
        reader.cancel()

    asyncio.run(main())


@pytest.mark.serial
def test_a_stalled_reader_is_aborted_and_slows_no_one(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1 ms a step: the stalled stream's 2,000 tokens outlast the stall check (about once a
    # second), however fast the machine decodes (0.4 ms a token here, with the decode mirror).
    monkeypatch.setenv("LUMEN_DEBUG_DELAY", "schedule=0.001")

    async def main() -> None:
        llm = AsyncLLM(_config(tiny_model_path), stall_timeout=0.5)
        try:
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            stalled = llm.generate(PROMPTS[0], long)
            await stalled.__anext__()  # then never read again
            started = time.monotonic()
            _, tokens, _ = await _drain(llm, PROMPTS[1], long.clone(max_tokens=60))
            print(f"reader beside a stalled one: 60 tokens in {time.monotonic() - started:.2f}s")
            assert len(tokens) == 60
            # The stall check runs about once a second: poll until it aborted the request.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                stats = await llm.get_stats()
                if (stats.num_running, stats.num_waiting) == (0, 0):
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(StreamStalledError):
                while True:
                    await stalled.__anext__()
            assert (await llm.get_stats()).num_running == 0
        finally:
            await llm.shutdown()

    asyncio.run(main())


@pytest.mark.serial
def test_dead_engine_fails_every_open_stream_within_1s(tiny_model_path: Path) -> None:
    async def main() -> None:
        llm = AsyncLLM(_config(tiny_model_path))
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        gens = [llm.generate(p, params) for p in PROMPTS[:3]]
        for g in gens:
            await g.__anext__()
        os.kill(llm.client.core.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        for g in gens:
            with pytest.raises(EngineDeadError):
                while True:
                    await g.__anext__()
        elapsed = time.monotonic() - killed
        print(f"3 open streams failed {elapsed * 1000:.0f} ms after kill -9")
        assert elapsed < 1.0
        with pytest.raises(EngineDeadError):
            await _drain(llm, PROMPTS[0], params)
        await llm.shutdown()

    asyncio.run(main())
    assert wait_no_children() == []


def test_a_request_that_sent_nothing_waits_for_the_next_core(tiny_model_path: Path) -> None:
    """A supervised engine whose core dies: the stream that has sent output fails at once
    (EngineRestartingError), while a queued stream that has sent nothing and a non-streamed
    request (its output is one whole response) are sent again to the next core and finish
    whole; a request that waits longer than ``resubmit_timeout`` for that core fails."""

    async def main() -> None:
        config = EngineConfig(model=str(tiny_model_path), num_kv_blocks=128, max_num_seqs=2)
        llm = AsyncLLM(config, supervised=True, resubmit_timeout=30)
        long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
        short = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        try:
            running = llm.generate(PROMPTS[0], long)
            await running.__anext__()  # it has sent output
            whole = asyncio.create_task(_whole(llm, PROMPTS[1], long))  # the second slot
            queued = asyncio.create_task(_drain(llm, PROMPTS[2], short))  # waits for a slot
            await asyncio.sleep(0.2)
            os.kill(llm.client.core.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineRestartingError):
                async for _ in running:
                    pass
            await asyncio.wait_for(llm.wait_dead(), 10)
            assert not queued.done() and not whole.done()
            await llm.restart()
            _, tokens, finish = await asyncio.wait_for(queued, 30)
            assert (len(tokens), finish) == (24, "length")
            assert await asyncio.wait_for(whole, 60) == 1500
            assert llm.num_failed == 1
        finally:
            await llm.shutdown()

    async def expire() -> None:
        llm = AsyncLLM(_config(tiny_model_path), supervised=True, resubmit_timeout=0.5)
        try:
            params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
            waiting = asyncio.create_task(_whole(llm, PROMPTS[3], params))
            await asyncio.sleep(0.2)
            os.kill(llm.client.core.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineRestartingError):  # no new core within 0.5 s
                await asyncio.wait_for(waiting, 10)
        finally:
            await llm.shutdown()

    asyncio.run(main())
    asyncio.run(expire())


async def _whole(llm: AsyncLLM, prompt, params: SamplingParams) -> int:
    """A non-streamed request's tokens: its one output."""
    outs = [out async for out in llm.generate(prompt, params, stream=False)]
    assert len(outs) == 1 and outs[0].finished
    return len(outs[0].outputs[0].token_ids)
