"""Block hashes: chained over full blocks only, stable across processes."""

from __future__ import annotations

import pytest

from services.engine.blocks import BlockHash, encode_tokens, hash_blocks

pytestmark = pytest.mark.unit


def test_only_full_blocks_are_hashed() -> None:
    assert hash_blocks([], 4) == []
    assert hash_blocks([1, 2, 3], 4) == []
    assert len(hash_blocks(list(range(11)), 4)) == 2
    assert hash_blocks(list(range(11)), 4) == hash_blocks(list(range(8)), 4)


def test_hashes_are_16_bytes_of_hex() -> None:
    (block_hash,) = hash_blocks([1, 2, 3, 4], 4)
    assert len(block_hash) == 32
    assert int(block_hash, 16) >= 0


def test_golden_values_pin_the_encoding() -> None:
    # blake2b is not salted per process (unlike hash()), so these hold on every run; a
    # change of the encoding would orphan every hash already on the log and fails here.
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4) == [
        BlockHash("500d088003dcd06216e5ad4fe55ab265"),
        BlockHash("cce1a339c80b01937f20f43b19e08cc8"),
    ]


def test_a_hash_covers_its_whole_prefix() -> None:
    one = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    other = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert one[0] != other[0]
    assert one[1] != other[1]  # same tokens in block 1, different parent


def test_parent_extends_a_chain_without_rehashing() -> None:
    tokens = list(range(40))
    whole = hash_blocks(tokens, 4)
    assert hash_blocks(tokens[12:], 4, parent=whole[2]) == whole[3:]


def test_block_size_and_token_values_matter() -> None:
    assert hash_blocks(list(range(8)), 8) != hash_blocks(list(range(8)), 4)[:1]
    assert hash_blocks([0, 0, 0, 1], 4) != hash_blocks([0, 0, 1, 0], 4)
    assert hash_blocks([2**40, 0], 2) != hash_blocks([0, 0], 2)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1], 0)
    with pytest.raises(ValueError, match="not a block hash"):
        hash_blocks([1, 2], 2, parent=BlockHash("xyz"))
    with pytest.raises(ValueError, match="64-bit"):
        hash_blocks([2**70, 1], 2)


def test_encoding_is_little_endian_int64() -> None:
    assert encode_tokens([1, -1]) == b"\x01" + b"\x00" * 7 + b"\xff" * 8
