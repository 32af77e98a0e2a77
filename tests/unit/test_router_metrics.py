"""vllm-router's Prometheus endpoint (worker URLs, request counts) answers nobody unless --router-prometheus-port
asks for it (`vime.backends.vllm_utils.router_metrics`): the real vllm-router, started as a run starts it, with a
worker registered. Also the two halves of closing it, on sockets of this process: the drop-everything filter on a
listener, and the shutting of a connection it took before."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

from vime.utils.listeners import hex_address, listeners, process_tree, socket_inodes, tcp_sockets
from vime.utils.misc import find_free_port

WORKER = textwrap.dedent('''
    import http.server, sys
    class Healthy(http.server.BaseHTTPRequestHandler):  # what the router asks of a worker it registers
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Healthy).serve_forever()
''')


def metrics_from(port: int) -> str | None:
    """What GET /metrics on loopback `port` answers, or None when nothing answers within 2 s."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except OSError:
        return None


def listening_ports(pid: int) -> set[int]:
    """The ports the process tree of `pid` listens on."""
    ours = socket_inodes(process_tree(pid))
    return {int(local.rsplit(":", 1)[1], 16) for local, _, state, _, inode in tcp_sockets()
            if state == "0A" and inode in ours}


@pytest.fixture
def started_router(tmp_path):
    """start(*flags) -> vime's router with one worker registered (a server that answers /health), as a run starts
    it; stopped afterwards."""
    from vime.arguments import build_parser
    from vime.backends.vllm_utils.arguments import router_args_from
    from vime.backends.vllm_utils.router import Router
    from vime.utils.auth import RunToken

    started = []
    worker_port = find_free_port()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(worker_port)], cwd=tmp_path)
    deadline = time.monotonic() + 30
    while not listeners(worker_port) and time.monotonic() < deadline:
        time.sleep(0.05)

    def start(*flags: str) -> Router:
        token = RunToken.new()
        args = router_args_from(build_parser().parse_args(["--hf-checkpoint", "x", *flags]), "127.0.0.1",
                                find_free_port(), [], api_key=token.serving_key())
        router = Router(args, str(tmp_path), token)
        started.append(router)
        router.start(timeout_s=60)
        router.add_worker(f"http://127.0.0.1:{worker_port}")
        return router

    yield start
    for router in started:
        router.stop()
    worker.kill()
    worker.wait()


def test_the_routers_metrics_answer_nobody_by_default(started_router):
    router = started_router()
    others = listening_ports(router.proc.pid) - {router.router_args.port}
    assert others  # the door, and the exporter vllm-router opens whatever it is told
    answers = {port: metrics_from(port) for port in others}
    assert not [port for port, text in answers.items() if text and "vllm_router" in text], answers
    assert "closed to other users" not in (router.log_path.read_text())


def test_the_routers_metrics_are_served_where_asked(started_router):
    port = find_free_port()
    started_router("--router-prometheus-port", str(port))
    text = metrics_from(port)
    assert text is not None and "vllm_router" in text


def test_a_filtered_listener_answers_no_connection_attempt():
    from vime.backends.vllm_utils.router_metrics import drop_everything

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        drop_everything(server.fileno())
        with socket.socket() as client, pytest.raises(TimeoutError):
            client.settimeout(1)
            client.connect(server.getsockname())


def test_a_connection_taken_before_the_filter_is_shut():
    from vime.backends.vllm_utils.router_metrics import shut_connections, socket_fds

    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
        accepted, _ = server.accept()
        address = hex_address(*server.getsockname())
        assert shut_connections(address, socket_fds()) == 1  # it was open
        client.settimeout(5)
        assert client.recv(1) == b""  # the server's side ended it
        deadline = time.monotonic() + 5
        while shut_connections(address, socket_fds()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shut_connections(address, socket_fds()) == 0
        accepted.close()
