"""Tensor- and pipeline-parallel workers serving the default model (9 query and 3 key/value heads: three
ranks) answer chats exactly as one single-process worker does (float32: the sums of three
ranks round as one matmul's do only to float32 precision, which greedy decoding does not see
here; each token's logprob within 1e-4 of one process's) — under ``xlserve serve`` (prefill
and decode workers of three ranks each: rank 0 gathers every rank's KV heads into the
hand-off, the other worker's rank 0 scatters them), and with a three-rank prefill worker
handing off to a one-rank decode worker."""

import os

import psutil
import pytest
from openai import OpenAI

from tests.e2e.server_process import metric, metric_value, running_server

COMMON = ("--dtype", "float32", "--log-level", "warning")

CHATS = ["Name three primary colors.", "What is the capital of France? Answer in one sentence.",
         "Write a haiku about the sea."]


def _answers(url: str) -> list[tuple[str, list[float]]]:
    """Each chat's answer and its tokens' logprobs."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    choices = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": c}], max_tokens=32,
                                              temperature=0, logprobs=True).choices[0] for c in CHATS]
    return [(c.message.content, [t.logprob for t in c.logprobs.content]) for c in choices]


def _answer_as(reference: list[tuple[str, list[float]]], url: str) -> None:
    """The same text, each token's logprob within float32 rounding of the ranks' sums (a rank's
    share lost or counted twice moves them by far more)."""
    answers = _answers(url)
    assert [text for text, _ in answers] == [text for text, _ in reference]
    worst = max(abs(a - b) for (_, mine), (_, theirs) in zip(answers, reference) for a, b in zip(mine, theirs))
    assert worst < 1e-4  # 3.8e-6 measured


@pytest.fixture(scope="module")
def reference() -> list[tuple[str, list[float]]]:
    with running_server(*COMMON) as single:
        return _answers(single)


def _alive(procs) -> list:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_three_ranks_per_worker_answer_as_one_process(reference):
    with running_server(*COMMON, "--tensor-parallel-size", "3", command="serve", timeout=300) as split:
        ranks = [p for p in psutil.Process().children(recursive=True) if "xlserve.parallel.follower" in p.cmdline()]
        assert len(ranks) == 4  # two workers, each with ranks 1 and 2 beside itself
        _answer_as(reference, split)
        assert metric(split, "xlserve_kv_transfer_bytes_total") > 0  # the decode worker pulled the blocks
    assert not _alive(ranks)


def test_a_three_rank_prefill_worker_hands_off_to_a_one_rank_decode_worker(reference):
    with running_server(*COMMON, "--role", "prefill", "--tensor-parallel-size", "3") as prefill, \
            running_server(*COMMON, "--role", "decode") as decode, \
            running_server("--prefill", prefill, "--decode", decode, "--log-level", "warning",
                           command="router") as router:
        _answer_as(reference, router)
        assert metric(router, "xlserve_kv_transfer_bytes_total") > 0  # the decode worker pulled the blocks


def test_a_two_stage_prefill_worker_hands_off_to_a_one_stage_decode_worker(reference):
    """Pipeline parallel: the default model's 30 layers in two stages answer as one process,
    and the prefill worker's rank 0 gathers the other stage's layers into the hand-off."""
    with running_server(*COMMON, "--role", "prefill", "--pipeline-parallel-size", "2") as prefill, \
            running_server(*COMMON, "--role", "decode") as decode, \
            running_server("--prefill", prefill, "--decode", decode, "--log-level", "warning",
                           command="router") as router:
        _answer_as(reference, router)
        assert metric(router, "xlserve_kv_transfer_bytes_total") > 0


def test_a_killed_rank_takes_its_worker_down_and_the_router_serves_from_the_other():
    """A rank killed while its worker idles: the worker notices between steps and exits (the
    supervisor's cue to restart it) with no rank left behind; the router answers from the
    other worker meanwhile."""
    import signal

    import httpx

    from tests.e2e.server_process import PROCESSES
    from xlserve.worker.server import EXIT_ENGINE_DEAD
    with running_server(*COMMON, "--tensor-parallel-size", "3") as split, running_server(*COMMON) as single, \
            running_server("--both", split, single, "--log-level", "warning", command="router") as router:
        worker = PROCESSES[split]
        ranks = [p for p in psutil.Process(worker.pid).children() if "xlserve.parallel.follower" in p.cmdline()]
        assert len(ranks) == 2
        ranks[0].send_signal(signal.SIGKILL)
        assert worker.wait(timeout=30) == EXIT_ENGINE_DEAD
        assert not _alive(ranks)
        chat = {"model": "default", "messages": [{"role": "user", "content": CHATS[0]}], "max_tokens": 8}
        for _ in range(3):
            assert httpx.post(f"{router}/v1/chat/completions", json=chat, timeout=60).status_code == 200


@pytest.mark.parametrize("split", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_two_nodes_on_loopback_serve_a_request(tiny_model_dirs, tmp_path, split):
    """--nnodes 2: node 0's worker serves with rank 0, node 1's hosts rank 1 (half of every
    layer, or the second pipeline stage); they meet at --master-port and answer as one
    process; stopping node 0 stops node 1's rank."""
    import subprocess
    import sys

    from tests.e2e.server_process import free_port
    from tests.e2e.test_model_families import _with_word_tokenizer
    model = _with_word_tokenizer(tiny_model_dirs["llama"], tmp_path / "llama")
    prompt = " ".join(f"t{i}" for i in range(20, 60))

    def complete(url: str) -> str:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=16,
                                         temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    with running_server("--model", model, *COMMON) as single:
        expected = complete(single)
    port, key = free_port(), tmp_path / "distributed.key"
    key.write_text("a shared secret of the two nodes\n")
    nodes = ("--model", model, *COMMON, split, "2", "--nnodes", "2", "--master-port", str(port),
             "--distributed-key-file", str(key))
    node1 = subprocess.Popen([sys.executable, "-m", "xlserve.cli", "worker", *nodes, "--node-rank", "1"])
    try:
        with running_server(*nodes) as node0:
            assert complete(node0) == expected
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()


def test_nodes_that_disagree_on_the_model_or_pool_refuse_to_start(tiny_model_dirs, tmp_path):
    """Each node starts from its own flags: a node whose KV pool (or model, or dtype) differs
    from node 0's is found after loading, and both sides exit non-zero with the reason."""
    import subprocess
    import sys

    from tests.e2e.server_process import free_port
    port, key = free_port(), tmp_path / "distributed.key"
    key.write_text("a shared secret of the two nodes\n")
    nodes = ("--model", tiny_model_dirs["llama"], *COMMON, "--tensor-parallel-size", "2", "--nnodes", "2",
             "--master-port", str(port), "--distributed-key-file", str(key))
    node1 = subprocess.Popen([sys.executable, "-m", "xlserve.cli", "worker", *nodes, "--node-rank", "1",
                              "--kv-cache-tokens", "4096"], stderr=subprocess.PIPE, text=True)
    node0 = subprocess.Popen([sys.executable, "-m", "xlserve.cli", "worker", *nodes, "--port", str(free_port())],
                             stderr=subprocess.PIPE, text=True)
    try:
        assert node0.wait(timeout=120) != 0 and node1.wait(timeout=60) != 0
        assert "load another model, dtype or KV pool than rank 0" in node0.stderr.read()
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()


def test_a_node_without_the_key_cannot_take_a_rank(tiny_model_dirs, tmp_path):
    """Several nodes meet over the network: a worker without a key is refused before it
    starts a rank, and a process that reaches --master-port with another key is refused by
    every rank (the HMAC handshake), so neither side starts."""
    import subprocess
    import sys

    from tests.e2e.server_process import free_port
    port, ours, theirs = free_port(), tmp_path / "ours.key", tmp_path / "theirs.key"
    ours.write_text("the worker's key\n")
    theirs.write_text("a guess\n")
    nodes = ("--model", tiny_model_dirs["llama"], *COMMON, "--pipeline-parallel-size", "2", "--nnodes", "2",
             "--master-port", str(port))
    keyless = subprocess.run([sys.executable, "-m", "xlserve.cli", "worker", *nodes], capture_output=True, text=True,
                             timeout=60, env={k: v for k, v in os.environ.items() if k != "XLSERVE_DISTRIBUTED_KEY"})
    assert keyless.returncode != 0 and "--distributed-key-file" in keyless.stderr
    impostor = subprocess.Popen([sys.executable, "-m", "xlserve.cli", "worker", *nodes, "--node-rank", "1",
                                 "--distributed-key-file", str(theirs)], stderr=subprocess.PIPE, text=True)
    node0 = subprocess.Popen([sys.executable, "-m", "xlserve.cli", "worker", *nodes, "--port", str(free_port()),
                              "--distributed-key-file", str(ours)], stderr=subprocess.PIPE, text=True)
    try:
        assert node0.wait(timeout=60) != 0 and impostor.wait(timeout=60) != 0
        assert "did not prove they hold the distributed key" in node0.stderr.read()
        assert "did not prove they hold the distributed key" in impostor.stderr.read()
    finally:
        for proc in (node0, impostor):
            if proc.poll() is None:
                proc.kill()


def test_data_parallel_attention_serves_concurrent_requests_as_one_process(tiny_model_dirs, tmp_path):
    """--data-parallel-attention on a MoE model with latent attention (whose KV does not split by
    head): concurrent completions, spread over both ranks' own KV pools, answer as one process
    does, colocated and under ``xlserve serve`` (prefill and decode workers of two ranks each:
    the pinned prefix read from the rank that holds it, imported into the decode worker's
    least busy rank)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.test_model_families import _with_word_tokenizer
    model = _with_word_tokenizer(tiny_model_dirs["deepseek_v3"], tmp_path / "deepseek")
    prompts = [" ".join(f"t{i}" for i in range(start, start + n)) for start, n in ((20, 40), (90, 12), (20, 50),
                                                                                   (130, 25), (5, 33), (20, 41))]

    def complete(url: str) -> list[str]:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model_id = client.models.list().data[0].id
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: client.completions.create(
                model=model_id, prompt=p, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].text, prompts))
    with running_server("--model", model, *COMMON) as single:
        expected = complete(single)
    options = ("--model", model, *COMMON, "--tensor-parallel-size", "2", "--expert-parallel",
               "--data-parallel-attention")
    with running_server(*options) as split:
        assert complete(split) == expected
        placed = [metric_value(split, "xlserve_dp_rank_requests_total", dp_rank=str(r)) for r in (0, 1)]
        assert sum(placed) == len(prompts) and min(placed) >= 2  # both ranks ran requests of their own
        assert metric_value(split, "xlserve_dp_rank_kv_blocks_used", dp_rank="1") == 0  # all freed
    with running_server(*options, command="serve", timeout=300) as disaggregated:
        assert complete(disaggregated) == expected
        assert metric(disaggregated, "xlserve_kv_transfer_bytes_total") > 0  # the decode worker pulled the blocks
