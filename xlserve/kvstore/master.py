"""``xlserve kvstore``: a Mooncake Store for the cluster KV tier, supervised.

It runs the Mooncake master (``mooncake_master`` from the ``mooncake`` package) and its
HTTP metadata server (no etcd), and mounts the store's memory itself, so workers are pure
clients and a worker that exits takes no blocks with it. Ports: the master's RPC on
``--port``, the metadata server on the next one, the master's metrics on the one after;
all bound to ``--host`` (127.0.0.1 unless told otherwise: the store has no authentication
of its own, so keep it on a private network). The metadata server is the package's own
(``mooncake.http_metadata_server``) rather than the master's built-in one, because the
built-in one listens on every interface whatever ``--http_metadata_server_host`` says
(measured with mooncake 0.3.13). A process that exits is restarted (the memory clients
reconnect by themselves); Ctrl-C or SIGTERM stops it all.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from xlserve.config import KVStoreConfig
from xlserve.kvstore.mooncake import CLIENT_BUFFER_BYTES, client_environment, new_client

log = logging.getLogger("xlserve.kvstore")
SEGMENT_GIB_MAX = 32  # one mounted segment at most: registrations above ~64 GiB fail (reported by its users)
READY_TIMEOUT_S = 30.0
READY_LINE = "xlserve kvstore: Mooncake store ready"


def master_binary() -> Path:
    import mooncake

    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise RuntimeError(f"the mooncake package has no mooncake_master at {path}")
    return path


def commands(opts: KVStoreConfig) -> dict[str, list[str]]:
    """The store's processes: the master and its metadata server."""
    return {
        "master": [str(master_binary()), f"--rpc_address={opts.host}", f"--rpc_port={opts.port}",
                   f"--metrics_host={opts.host}", f"--metrics_port={opts.port + 2}"],
        "metadata server": [sys.executable, "-m", "mooncake.http_metadata_server", "--host", opts.host,
                            "--port", str(opts.port + 1), "--log-level", "WARNING"],
    }


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def wait_ready(host: str, port: int, timeout: float = READY_TIMEOUT_S, procs: list[subprocess.Popen] = ()) -> None:
    """Until the master's RPC and metadata ports accept connections."""
    deadline = time.monotonic() + timeout
    while not (port_open(host, port) and port_open(host, port + 1)):
        if any(proc.poll() is not None for proc in procs):
            raise RuntimeError("a Mooncake store process exited while starting")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Mooncake master at {host}:{port} did not answer within {timeout:g} s")
        time.sleep(0.1)


class KVStore:
    """The master process, restarted when it exits, and the store's mounted memory."""

    def __init__(self, opts: KVStoreConfig):
        self.opts = opts
        self.procs: dict[str, subprocess.Popen] = {}
        self.segments = []  # Mooncake clients holding the memory
        self.restarts = 0
        self.stopping = False  # a plain flag: set from a signal handler, which must take no lock

    def start(self) -> None:
        client_environment(self.opts.host)
        for name in commands(self.opts):
            self._spawn(name)
        wait_ready(self.opts.host, self.opts.port, procs=list(self.procs.values()))
        remaining = self.opts.gib
        while remaining > 0:
            gib = min(remaining, SEGMENT_GIB_MAX)
            segment = new_client(self.opts.host, self.opts.port, int(gib * 1024 ** 3), CLIENT_BUFFER_BYTES)
            if segment is None:
                raise RuntimeError(f"could not mount {gib:g} GiB in the Mooncake store at {self.opts.address}")
            self.segments.append(segment)
            remaining -= gib
        log.info("Mooncake store on %s (metadata http://%s:%d/metadata): %g GiB", self.opts.address,
                 self.opts.host, self.opts.port + 1, self.opts.gib)

    def _spawn(self, name: str) -> None:
        from xlserve.supervisor import die_with_parent

        self.procs[name] = subprocess.Popen(commands(self.opts)[name], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def supervise(self) -> None:
        """Restart the master or the metadata server whenever it exits, until ``stop``."""
        while not self._pause(0.5):
            for name, proc in list(self.procs.items()):
                if proc.poll() is None:
                    continue
                self.restarts += 1
                # Ctrl-C reaches the whole process group: a child may exit before this
                # process hears of it, and one restarted then would outlive the stack
                if self._pause(min(5.0, 0.5 * self.restarts)):
                    return
                log.warning("the Mooncake %s exited (code %s); restarting it (restart %d)", name, proc.returncode,
                            self.restarts)
                self._spawn(name)

    def _pause(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True once asked to stop."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.stopping

    def request_stop(self) -> None:
        """Ends ``supervise`` (safe from a signal handler: it only sets a flag)."""
        self.stopping = True

    def stop(self) -> None:
        self.stopping = True
        for segment in self.segments:
            try:
                segment.close()
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        self.segments = []
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_kvstore(opts: KVStoreConfig) -> None:
    from xlserve.supervisor import raise_on_sigterm

    raise_on_sigterm()
    store = KVStore(opts)
    try:
        store.start()
        # from here Ctrl-C and SIGTERM only ask the loop to stop: an exception raised inside
        # a restart's fork would leave the new child unrecorded, and never stopped
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: store.request_stop())
        print(f"{READY_LINE} at {opts.address} ({opts.gib:g} GiB); Ctrl-C stops it", flush=True)
        store.supervise()
    except KeyboardInterrupt:
        pass
    finally:
        store.stop()


def spawn_kvstore(config: KVStoreConfig) -> subprocess.Popen:
    """``xlserve kvstore`` as a child process (``xlserve serve`` starts one); returns once its
    memory is mounted."""
    from xlserve.supervisor import die_with_parent

    args = [sys.executable, "-m", "xlserve.cli", "kvstore", "--host", config.host, "--port", str(config.port),
            "--gib", str(config.gib), "--log-level", config.log_level]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(READY_TIMEOUT_S)
    if not lines or not lines[0].startswith(READY_LINE):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"xlserve kvstore did not start on {config.address} within {READY_TIMEOUT_S:g} s "
                           f"(exit code {proc.returncode})")
    return proc
