"""The supervisor on stand-in worker processes (no model): restarts with a named cause,
backoff, a budget that gives up, and health failures of a live process."""

import http.server
import subprocess
import sys
import threading
import time

from xlserve.server_config import SupervisorConfig
from xlserve.supervisor import Supervisor, WorkerProcess, exit_cause

FAST = dict(check_interval=0.05, max_backoff=0.0, startup_timeout=5.0)


def _spawner(script: str, starts: list):
    def spawn():
        starts.append(time.monotonic())
        return subprocess.Popen([sys.executable, "-c", script])
    return spawn


def test_a_worker_that_keeps_exiting_is_restarted_until_the_budget_is_spent(caplog):
    starts, gave_up = [], []
    worker = WorkerProcess("decode", "http://127.0.0.1:9", _spawner("import sys; sys.exit(7)", starts))
    worker.start()
    supervisor = Supervisor([worker], SupervisorConfig(max_restarts=3, restart_window=60, **FAST), gave_up.append)
    supervisor.start()
    deadline = time.monotonic() + 20
    while not gave_up and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.stop()
    assert len(starts) == 4  # the first start and three restarts
    assert gave_up and "exited with code 7" in gave_up[0] and "restarted 3 times" in gave_up[0]
    assert "decode worker http://127.0.0.1:9 (pid" in caplog.text and "exited with code 7; restarting" in caplog.text


def test_backoff_doubles_with_recent_restarts():
    starts, gave_up = [], []
    worker = WorkerProcess("prefill", "http://127.0.0.1:9", _spawner("import sys; sys.exit(1)", starts))
    worker.start()
    config = SupervisorConfig(max_restarts=3, restart_window=60, check_interval=0.05, max_backoff=30,
                              startup_timeout=5)
    supervisor = Supervisor([worker], config, gave_up.append)
    supervisor.start()
    deadline = time.monotonic() + 20
    while not gave_up and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.stop()
    waits = [b - a for a, b in zip(starts, starts[1:])]
    assert len(waits) == 3 and waits[1] >= 1.0 and waits[2] >= 3.0  # 0, 1, 3 s of backoff (+ checks)


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b'{"error": {"message": "engine hung: one step has run for 61 s"}}')

    def log_message(self, *args):
        pass


def test_a_live_worker_failing_health_is_killed_and_restarted():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    starts, gave_up = [], []
    worker = WorkerProcess("decode", url, _spawner("import time; time.sleep(60)", starts))
    worker.start()
    first = worker.proc
    supervisor = Supervisor([worker], SupervisorConfig(unhealthy_restart=0.3, **FAST), gave_up.append)
    supervisor.start()
    try:
        time.sleep(0.5)
        assert len(starts) == 1 and worker.ready  # healthy: left alone
        _Health.status = 503
        deadline = time.monotonic() + 10
        while len(starts) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(starts) == 2 and first.poll() is not None and not gave_up
    finally:
        _Health.status = 200
        supervisor.stop()
        worker.kill()
        server.shutdown()


def test_exit_causes_name_the_signal():
    assert exit_cause(-9) == "killed by SIGKILL" and exit_cause(3) == "exited with code 3"
