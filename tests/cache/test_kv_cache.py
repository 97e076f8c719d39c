import pytest
import torch

from minidsa import ops
from minidsa.cache import CacheLayout, OutOfKVBlocksError, PagedKVCache, Plane


def make_cache(num_blocks=6, block_size=4):
    layout = CacheLayout((Plane("a", 3, torch.float32), Plane("b", 1, torch.float32)), num_layers=2,
                         block_size=block_size, num_blocks=num_blocks)
    return PagedKVCache(layout)


def test_block_accounting_at_boundaries():
    c = make_cache(block_size=4)
    s = c.add_sequence()
    assert c.blocks_needed(s, 0) == 0
    assert c.blocks_needed(s, 4) == 1
    assert c.blocks_needed(s, 5) == 2
    c.reserve({s: 4})
    assert len(c.block_table(s)) == 1 and c.blocks_needed(s, 4) == 0 and c.blocks_needed(s, 5) == 1
    c.commit(s, 4)
    assert c.block_tokens[c.block_table(s)[0]] == 4
    with pytest.raises(ValueError, match="reserved"):
        c.commit(s, 5)


def test_slot_mapping_with_interleaved_sequences():
    c = make_cache(num_blocks=8, block_size=4)
    a, b = c.add_sequence(), c.add_sequence()
    for n in (3, 6, 9):  # grow both in turns so their tables interleave
        c.reserve({a: n, b: n})
    ta = c.block_table(a)
    assert ta != list(range(ta[0], ta[0] + len(ta))), "tables must interleave for this test"
    pos = torch.arange(9)
    expect = torch.tensor([ta[p // 4] * 4 + p % 4 for p in range(9)])
    assert torch.equal(c.kv_slots(a, pos), expect)
    assert torch.equal(c.kv_slots(a, torch.tensor([-1, 2])), torch.tensor([-1, ta[0] * 4 + 2]))
    assert set(ta).isdisjoint(c.block_table(b))
    assert all(c.block_owner[x] == a for x in ta)
    with pytest.raises(ValueError, match="reserve"):
        c.kv_slots(a, torch.tensor([12]))
    bt = c.block_table_tensor([a, b])
    assert bt.dtype == torch.int32 and bt[0].tolist() == ta


def test_running_out_is_all_or_nothing_and_release_works():
    c = make_cache(num_blocks=4, block_size=4)
    a, b = c.add_sequence(), c.add_sequence()
    c.reserve({a: 8})
    with pytest.raises(OutOfKVBlocksError, match="needs 3 more blocks.*only 2"):
        c.reserve({a: 9, b: 8})
    assert c.num_free_blocks == 2 and c.block_table(b) == [] and len(c.block_table(a)) == 2
    c.free(a)
    assert c.num_free_blocks == 4 and all(o == -1 for o in c.block_owner)
    c.reserve({b: 16})
    assert c.num_free_blocks == 0
    with pytest.raises(ValueError, match=f"unknown sequence id {a}"):
        c.seq_len(a)


def test_store_skips_minus_one_and_gather_never_reads_it():
    c = make_cache(num_blocks=2, block_size=4)
    plane = c.plane(0, "a")
    plane.fill_(float("nan"))  # garbage everywhere, as after reuse
    s = c.add_sequence()
    c.reserve({s: 3})
    slots = c.kv_slots(s, torch.tensor([0, 1, -1]))
    ops.store_kv(plane, slots, torch.arange(9.0).view(3, 3))
    table = c.block_table_tensor([s])
    got = ops.gather_positions(plane, table, torch.tensor([[1, -1, 0, -1]]))
    assert torch.equal(got, torch.tensor([[[3.0, 4, 5], [0, 0, 0], [0, 1, 2], [0, 0, 0]]]))
    third = c.kv_slots(s, torch.tensor([2]))
    assert torch.isnan(plane.view(-1, 3)[third]).all(), "the -1 row must not have written anything"


def test_truncate_releases_whole_blocks():
    c = make_cache(num_blocks=4, block_size=4)
    s = c.add_sequence()
    c.reserve({s: 10})
    c.commit(s, 10)
    c.truncate(s, 5)
    assert len(c.block_table(s)) == 2 and c.seq_len(s) == 5 and c.num_free_blocks == 2


def test_bad_lengths_and_ids_are_refused_before_anything_changes():
    c = make_cache(num_blocks=4, block_size=4)
    s = c.add_sequence()
    c.reserve({s: 6})
    c.commit(s, 6)
    for call, bad in ((c.truncate, -1), (c.commit, -3), (c.truncate, 7), (c.commit, 2.0), (c.truncate, True)):
        with pytest.raises(ValueError, match=f"sequence {s}: cannot"):
            call(s, bad)
    assert c.seq_len(s) == 6 and len(c.block_table(s)) == 2
    for bad in ("0", 1.0, None, [s]):
        with pytest.raises(TypeError, match="sequence id must be an int"):
            c.seq_len(bad)


def test_truncate_is_refused_where_kda_states_cannot_roll_back():
    import minidsa
    cache = minidsa.MiniDSA("tiny").new_cache()
    s = cache.add_sequence()
    cache.reserve({s: 8})
    cache.commit(s, 8)
    with pytest.raises(ValueError, match="KDA layers' recurrent states .* cannot be rolled back; free the sequence"):
        cache.truncate(s, 5)
    cache.truncate(s, 8)   # to its own length: nothing to roll back
    assert cache.seq_len(s) == 8


def test_reference_scale_memory_arithmetic():
    import minidsa
    layout = minidsa.MiniDSA("k3.1-pro", device="meta").cache_layout()
    # 24 MLA layers x (c_kv 512 + k_pe 64 in bf16, k_I 128 in e4m3 + one fp32 scale)
    assert layout.bytes_per_token() == 24 * ((512 + 64) * 2 + 128 + 4)
    # 69 KDA layers x (96 heads x 128 x 128 state + 3 conv states of 3 x 12288), fp32
    assert layout.state_bytes_per_sequence() == 69 * (96 * 128 * 128 + 3 * 3 * 12288) * 4
