from __future__ import annotations

from kvdepot.hashing import block_hashes, salt_hash, scope_seed, tokens_to_bytes


def test_dynamo_vector() -> None:
    """tokens 1..10, block size 4, salt 1337 -> Dynamo's sequence hashes; the tail has none."""
    assert block_hashes(tokens_to_bytes(list(range(1, 11))), 4, 1337) == [14643705804678351452, 4945711292740353085]


def test_default_salt_is_dynamo_empty_object() -> None:
    import xxhash

    assert salt_hash() == xxhash.xxh3_64_intdigest(b"{}", 0)


def test_salt_and_lora_change_every_hash() -> None:
    data = tokens_to_bytes(list(range(64)))
    base = block_hashes(data, 16, salt_hash())
    for seed in (salt_hash("s"), salt_hash(lora_name="l"), scope_seed(salt_hash(), "tenant"), scope_seed(salt_hash(), "", "model")):
        other = block_hashes(data, 16, seed)
        assert all(a != b for a, b in zip(base, other))
    assert scope_seed(123, "", "") == 123


def test_incremental_chain_equals_one_shot() -> None:
    """A slot hashes its blocks as tokens arrive; the chain is the same as hashing at once."""
    from kvdepotd.core.slots import Slot

    toks = list(range(1000, 1100))
    slot = Slot("r", 7, 16)  # type: ignore[arg-type]
    for i in range(0, 100, 7):
        slot.append_tokens(tokens_to_bytes(toks[i : i + 7]))
    assert slot.num_tokens == 100
    assert slot.hashes == block_hashes(tokens_to_bytes(toks), 16, 7)
    assert len(slot.states) == len(slot.hashes) == 6


def test_start_and_limit() -> None:
    data = tokens_to_bytes(list(range(160)))
    full = block_hashes(data, 16, 1)
    assert block_hashes(data, 16, 1, start_block=3, prev=full[2], limit=4) == full[3:7]


def test_tokens_to_bytes_is_little_endian_u32_and_rejects_what_does_not_fit() -> None:
    import array
    import struct

    import pytest

    toks = [0, 1, 255, 256, 65535, 2**32 - 1]
    assert tokens_to_bytes(toks) == struct.pack("<6I", *toks)
    assert tokens_to_bytes(array.array("I", toks)) == tokens_to_bytes(tuple(toks)) == tokens_to_bytes(toks)
    assert tokens_to_bytes([]) == b""
    for bad in ([-1], [2**32], [1.5], ["7"]):
        with pytest.raises(ValueError, match="integers in"):
            tokens_to_bytes(bad)  # type: ignore[arg-type]
