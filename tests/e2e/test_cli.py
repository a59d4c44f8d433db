"""`xlserve generate --json` and `--help` as a user runs them."""

import json
import subprocess
import sys


def _xlserve(*args):
    return subprocess.run([sys.executable, "-m", "xlserve.cli", *args], capture_output=True, text=True,
                          timeout=300)


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
