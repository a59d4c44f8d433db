"""`xlserve generate --json` and `--help` as a user runs them."""

import json
import re
import socket
import subprocess
import sys

import pytest


def _xlserve(*args):
    return subprocess.run([sys.executable, "-m", "xlserve.cli", *args], capture_output=True, text=True,
                          timeout=600)  # bench engine: 299 s alone on a 2-core first-generation Zen


def test_generate_json_greedy_is_reproducible():
    args = ("generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "12", "--json")
    first = _xlserve(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert set(out) == {"token_ids", "text", "finish_reason", "prompt_tokens", "cached_tokens"}
    assert 0 < len(out["token_ids"]) <= 12 and out["prompt_tokens"] > 10 and "Paris" in out["text"]
    assert json.loads(_xlserve(*args).stdout)["token_ids"] == out["token_ids"]


def test_help_and_bad_flags():
    help_text = _xlserve("serve", "--help").stdout
    for flag in ("--model", "--block-size", "--max-num-batched-tokens", "--api-key", "--host"):
        assert flag in help_text
    bad = _xlserve("generate", "--prompt", "x", "--block-size", "3")
    assert bad.returncode == 2 and "block_size must be a power of two" in bad.stderr
    missing = _xlserve("generate", "--prompt", "x", "--model", "/no/such/model")
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_each_command_shows_only_the_flags_it_takes():
    def flags(command):
        return set(re.findall(r"^\s+(--[a-z-]+)", _xlserve(command, "--help").stdout, re.M))
    serve, worker, router = flags("serve"), flags("worker"), flags("router")
    assert {"--role", "--kv-host", "--kv-port", "--kv-peers"} <= worker - serve - router  # serve picks these
    assert {"--worker-timeout", "--router-queue", "--router-queue-timeout"} <= (router & serve) - worker
    assert "--hang-timeout" in worker & serve and "--hang-timeout" not in router
    assert {"--prefill", "--decode", "--policy"} <= router - serve - worker
    assert {"--max-restarts", "--colocated"} <= serve - worker - router
    assert {"--api-key-file", "--log-requests", "--port"} <= serve & worker & router


@pytest.mark.parametrize("command", ["serve", "worker", "router"])
def test_a_port_in_use_or_a_bad_model_is_one_error_line_before_anything_loads(command, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = _xlserve(command, "--port", port)
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    for run, expected in ((busy, f"cannot listen on 127.0.0.1:{port}"),
                          (_xlserve(command, "--model", "/no/such/model"), "not found"),
                          (_xlserve(command, "--model", str(tmp_path)), "NoSuchForCausalLM"),
                          (_xlserve(command, "--chat-template", "/no/such.jinja"), "cannot read the chat template")):
        assert run.returncode == 2, run.stderr
        assert run.stderr.count("xlserve: error:") == 1 and expected in run.stderr, run.stderr
        assert "Traceback" not in run.stderr


def test_bench_engine_runs_xlserve_and_reports_every_row(tmp_path):
    out = tmp_path / "bench.json"
    run = _xlserve("bench", "engine", "--systems", "xlserve", "--repeats", "1", "--out", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())["systems"]["xlserve"]
    for key in ("decode_b1_tok_s", "prefill_1000_tok_s", "prefill_4000_tok_s", "decode_b8_tok_s",
                "decode_b32_tok_s", "ttft_uncached_s", "ttft_cached_s", "peak_rss_mib", "cold_start_s"):
        assert result[key] > 0, key
    assert result["ttft_cached_s"] < result["ttft_uncached_s"]  # 3,900 of 4,000 tokens come from the cache
    assert "aggregate decode tok/s, 32 seqs" in run.stdout
    bad = _xlserve("bench", "engine", "--repeats", "0")
    assert bad.returncode == 2 and "repeats must be at least 1" in bad.stderr


def test_readme_routing_recipe_runs_as_written():
    """The README's 'Routing your own workers' block, run by bash with free ports in place
    of its fixed ones: the router starts at once and waits for the workers to load."""
    import os
    import pathlib
    import re
    import signal
    import time

    import httpx

    from tests.e2e.server_process import free_port
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    block = re.search(r"## Routing your own workers\s+```bash\n(.*?)```", readme, re.S).group(1)
    ports = {port: str(free_port()) for port in ("8101", "8102", "8000")}
    script = re.sub(r"\b(8101|8102|8000)\b", lambda m: ports[m.group(1)], block)
    proc = subprocess.Popen(["bash", "-c", script], cwd=pathlib.Path(__file__).parents[2], start_new_session=True)
    url = f"http://127.0.0.1:{ports['8000']}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as in the terminal the recipe is for
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(2)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
