"""Blocks of neighbours in trie order: spread over every replica, cut where prefixes part."""
from batchprompt.ray.blocks import block_size, cut


def test_block_size_spreads_small_jobs_and_caps_large_ones():
    assert block_size(16, replicas=2, blocks_in_flight=4, block_rows=64) == 2
    assert block_size(10_000, replicas=2, blocks_in_flight=4, block_rows=64) == 64
    assert block_size(1, replicas=8, blocks_in_flight=4, block_rows=64) == 1


def test_a_block_ends_where_the_shared_prefix_is_shortest():
    doc_a = [[1, 2, 3, 10, i] for i in range(5)]  # five questions on one document
    doc_b = [[1, 2, 3, 20, i] for i in range(5)]
    ids = doc_a + doc_b
    assert cut(ids, 6) == 5  # not 6: the second document's group starts whole in the next block
    assert cut(ids, 4) == 4  # no boundary within the second half: the full size
    assert cut(ids[:3], 8) == 3
