"""``xlserve serve --tensor-parallel-size 3``: the default model (9 query and 3 key/value
heads) on prefill and decode workers of three ranks each — the prefill worker's rank 0
gathers every rank's KV heads into the hand-off, the decode worker's scatters them — answers
chats exactly as one single-process worker does (float32: the sums of three ranks round as
one matmul's do only to float32 precision, which greedy decoding does not see here)."""

import psutil
from openai import OpenAI

from tests.e2e.server_process import metric, running_server

CHATS = ["Name three primary colors.", "What is the capital of France? Answer in one sentence.",
         "Write a haiku about the sea."]


def _answers(url: str) -> list[str]:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    return [client.chat.completions.create(model=model, messages=[{"role": "user", "content": c}], max_tokens=32,
                                           temperature=0).choices[0].message.content for c in CHATS]


def test_three_ranks_per_worker_answer_as_one_process():
    common = ("--dtype", "float32", "--log-level", "warning")
    with running_server(*common, "--tensor-parallel-size", "3", command="serve", timeout=300) as split:
        ranks = [p for p in psutil.Process().children(recursive=True) if "xlserve.parallel.follower" in p.cmdline()]
        assert len(ranks) == 4  # two workers, each with ranks 1 and 2 beside itself
        split_answers = _answers(split)
        assert metric(split, "xlserve_kv_transfer_bytes_total") > 0  # the decode worker pulled the blocks
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    with running_server(*common) as single:
        assert _answers(single) == split_answers
