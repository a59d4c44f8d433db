"""The trace replay's sampling and scaling: whole conversations, fixed tokens per block id,
lengths and times scaled as stated."""

import pytest

from xlserve.bench.trace_replay import TraceReplay, build_requests, describe, load_trace, sample_conversations

ROWS = [  # two conversations (second block 10 and 20) and a one-block request
    {"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [0, 10]},
    {"timestamp": 1000, "input_length": 700, "output_length": 32, "hash_ids": [0, 20]},
    {"timestamp": 3000, "input_length": 1500, "output_length": 320, "hash_ids": [0, 10, 11]},
    {"timestamp": 5000, "input_length": 300, "output_length": 3, "hash_ids": [0]},
    {"timestamp": 9000, "input_length": 1536, "output_length": 1, "hash_ids": [0, 20, 21]},
]


def test_whole_conversations_are_sampled_in_trace_order():
    for seed in range(10):
        picked = sample_conversations(ROWS, 5, seed)
        assert picked == [0, 1, 2, 3, 4]
        two = set(sample_conversations(ROWS, 2, seed))
        assert two in ({0, 2}, {1, 4}, {3, 0}, {3, 1})  # a whole conversation first, then the next


def test_lengths_times_and_shared_blocks_are_scaled():
    requests, scale = build_requests(ROWS, TraceReplay(requests=5, length_scale=1 / 32, duration_s=4.5))
    assert [len(r.prompt_token_ids) for r in requests] == [32, 22, 47, 9, 48]
    assert [r.max_tokens for r in requests] == [2, 1, 10, 1, 1]
    assert [r.arrival_s for r in requests] == pytest.approx([0, 0.5, 1.5, 2.5, 4.5])
    assert scale["time_scale"] == pytest.approx(0.5) and "x0.5" in describe(scale)
    a, b, c = requests[0].prompt_token_ids, requests[1].prompt_token_ids, requests[2].prompt_token_ids
    assert a[:16] == b[:16] == c[:16]  # block 0: the shared system prompt
    assert c[:32] == a and b[16:] != a[16:22]  # block 10 shared by one conversation only
    assert requests[0].conversation == requests[2].conversation != requests[1].conversation
    again, _ = build_requests(ROWS, TraceReplay(requests=5, length_scale=1 / 32, duration_s=4.5))
    assert again == requests


def test_the_shipped_trace_loads_and_bad_settings_are_refused(tmp_path):
    rows = load_trace(TraceReplay().path)
    assert len(rows) == 12031 and rows[0]["hash_ids"][0] == 0
    with pytest.raises(ValueError, match="requests must be at least 1"):
        TraceReplay(requests=0)
    with pytest.raises(ValueError, match="length_scale"):
        TraceReplay(length_scale=2)
    with pytest.raises(ValueError, match="less than one token per trace block"):
        TraceReplay(length_scale=1 / 1024)
