"""What an agent and an operator do to `xlserve serve` (router + prefill + decode) on day
one: cancel streams, send SIGHUP, kill the parent outright."""

import re
import signal
import time

import httpx
import openai
import psutil
import pytest

from tests.e2e.server_process import PROCESSES, metric, metric_value, running_server, workers_by_role

MODEL = "SmolLM2-135M-Instruct"


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def serve():
    with running_server("--log-level", "warning", command="serve") as url:
        yield url


def test_a_stream_cancelled_after_3_chunks_is_gone_from_the_decode_worker_within_1s(serve):
    decode = workers_by_role(serve)["decode"]
    aborted_before = metric_value(serve, "xlserve_request_success_total", finished_reason="abort")
    client = openai.OpenAI(base_url=f"{serve}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, stream=True, max_tokens=2000,
                                            messages=[{"role": "user", "content": "Count to a thousand."}],
                                            extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert metric(decode, "xlserve_num_requests_running") == 1  # it is generating on the decode worker
    stream.close()
    left = time.monotonic()
    while time.monotonic() - left < 5:
        if metric(decode, "xlserve_num_requests_running") == 0 and metric(decode, "xlserve_kv_blocks_used") == 0:
            break
        time.sleep(0.05)
    idle_after = time.monotonic() - left
    print(f"decode worker idle {idle_after * 1000:.0f} ms after the client left")
    assert idle_after < 1.0
    deadline = time.monotonic() + 5  # the router counts it once its generator has closed
    while metric_value(serve, "xlserve_request_success_total", finished_reason="abort") == aborted_before:
        assert time.monotonic() < deadline, "the router never counted the abort"
        time.sleep(0.1)
    assert metric_value(decode, "xlserve_request_success_total", finished_reason="abort") >= 1


def test_the_readme_talk_to_it_recipes_run_as_written(serve):
    """The README's curl and openai-client blocks, with this server's port for 8000."""
    import pathlib
    import subprocess
    import sys
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Talk to it", 1)[1].split("\n## ", 1)[0]
    curl = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("127.0.0.1:8000", serve[7:])
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1).replace("127.0.0.1:8000", serve[7:])
    answer = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert "Paris" in answer.stdout, answer.stdout + answer.stderr
    haiku = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, timeout=120)
    assert haiku.returncode == 0 and "cached prompt tokens:" in haiku.stdout, haiku.stdout + haiku.stderr


def test_sighup_stops_serve_and_its_router_and_workers_like_ctrl_c(serve):
    proc = PROCESSES[serve]
    children = [child.pid for child in psutil.Process(proc.pid).children()]
    assert len(children) == 3  # router, prefill and decode worker
    proc.send_signal(signal.SIGHUP)
    code = proc.wait(timeout=10)
    assert code >= 0, code  # it exited through its cleanup, not killed by the signal's default action
    assert _gone_within(children, 1)


def test_sigkill_of_serve_leaves_no_router_or_worker_after_10s():
    with running_server("--log-level", "warning", command="serve") as url:
        proc = PROCESSES[url]
        children = [child.pid for child in psutil.Process(proc.pid).children()]
        assert len(children) == 3
        proc.kill()  # no cleanup runs in serve: only the kernel's parent-death signal reaches them
        proc.wait()
        assert _gone_within(children, 10)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=1)
