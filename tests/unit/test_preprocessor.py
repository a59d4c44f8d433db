"""A server's preprocessor tokenizes on its own threads, so the tokenizer's per-thread word
caches are as many as those threads, not as many as the host's cores."""

import os
import subprocess
import sys

PROBE = """
import os
from tokenizers import Tokenizer, models, pre_tokenizers
from xlserve.loader.tokenizer import Tokenizer as XlTokenizer
from xlserve.openai.serving_common import Preprocessor

vocab = {c: i for i, c in enumerate("abcdefgh ")}
backend = Tokenizer(models.BPE(vocab, []))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = XlTokenizer(backend, bos_token_id=None, eos_token_ids=set(), add_bos=False, chat_template=None)
before = len(os.listdir("/proc/self/task"))
preprocessor = Preprocessor(threads=2)
for _ in range(20):
    preprocessor.pool.submit(tokenizer.encode, "abc defg hh " * 50).result()
print(len(os.listdir("/proc/self/task")) - before)
"""


def _threads_added(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_tokenizing_starts_no_thread_per_core_unless_asked():
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    env["RAYON_NUM_THREADS"] = "8"  # what rayon would start on an 8-core host
    assert _threads_added(env) <= 2  # the preprocessing threads, nothing else
    # The user's own setting is kept: parallel, rayon's 8 workers come up.
    assert _threads_added({**env, "TOKENIZERS_PARALLELISM": "true"}) >= 8
