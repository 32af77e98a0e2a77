"""LocalSandbox stops and reports what it must: runaway time, fork bombs, writes outside, network, memory."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from vime.agents.sandbox import LocalSandbox, SandboxLimits, make_sandbox

pytestmark = pytest.mark.skipif(not os.path.exists("/proc"), reason="LocalSandbox needs Linux")
QUICK = SandboxLimits(wall_time_s=3, max_processes=16)


def _run(sandbox=None, **kw):
    kw.setdefault("limits", QUICK)
    return asyncio.run((sandbox or LocalSandbox()).run(**kw))


def _live_sandbox_processes() -> list[int]:
    """Pids whose environment carries a sandbox id: anything a sandboxed program left running."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"VIME_SANDBOX_ID=" in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_normal_program_output_and_files():
    r = _run(code="import sys, pathlib\nprint(pathlib.Path('data.txt').read_text().upper())\n"
                  "pathlib.Path('out.txt').write_text('inside is fine')\nprint('warn', file=sys.stderr)\nsys.exit(3)",
             files={"data.txt": "hello"})
    assert r.stdout == "HELLO\n" and r.stderr == "warn\n"
    assert r.exit_code == 3 and r.stopped_reason is None and not r.violations
    assert not r.ok


def test_command_and_shell_string():
    assert _run(command=["echo", "a", "b"]).stdout == "a b\n"
    r = _run(command="cat in.txt | wc -c", files={"in.txt": "12345"})
    assert r.ok and r.stdout.strip() == "5"


def test_infinite_loop_is_killed_at_wall_time():
    start = time.monotonic()
    r = _run(code="while True:\n    pass", limits=SandboxLimits(wall_time_s=1.5))
    assert r.stopped_reason == "timeout" and r.exit_code < 0
    assert 1.4 < time.monotonic() - start < 8
    assert not _live_sandbox_processes()


def test_sleeping_child_in_background_is_killed_too():
    r = _run(command="sleep 300 & sleep 300 & echo started", limits=SandboxLimits(wall_time_s=2))
    assert r.stdout == "started\n" and r.duration_s < 5  # the shell ended; its children died with it
    assert not _live_sandbox_processes()


needs_pid_namespace = pytest.mark.skipif(not LocalSandbox().isolation["pid_namespace"],
                                         reason="no unprivileged pid namespace here: no fork bomb without a sure kill")


@needs_pid_namespace
def test_fork_bomb_is_stopped_and_cleaned_up():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    r = _run(code=bomb, limits=SandboxLimits(wall_time_s=2, max_processes=16))
    assert r.stopped_reason == "process_limit", r
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 5
    while _live_sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _live_sandbox_processes()


@needs_pid_namespace
def test_shell_fork_bomb_is_stopped():
    r = _run(command="f() { f | f & }; f; sleep 1", limits=SandboxLimits(wall_time_s=2, max_processes=16))
    assert r.stopped_reason == "process_limit", r
    assert not _live_sandbox_processes()


@pytest.mark.parametrize("code", [
    "open('{target}', 'w').write('x')",
    "import os\nos.system('echo x > {target}')",  # a shell: no audit hook, Landlock refuses
    "import ctypes\nfd = ctypes.CDLL(None).open(b'{target}', 0o101, 0o644)\nprint(fd)",  # raw libc call
    "import shutil\nshutil.copy('a.txt', '{target}')",
])
def test_write_outside_the_directory_is_refused(tmp_path, code):
    os.chmod(tmp_path, 0o777)  # world-writable, like /tmp: only the sandbox can stop the write
    target = tmp_path / "escaped.txt"
    r = _run(code=code.format(target=target), files={"a.txt": "a"})
    assert not target.exists(), r
    assert r.stopped_reason == "forbidden_write" or r.stdout.strip() == "-1", r


def test_write_outside_is_reported_by_name(tmp_path):
    os.chmod(tmp_path, 0o777)
    r = _run(code=f"open('{tmp_path}/x', 'w')")
    assert r.stopped_reason == "forbidden_write" and r.violations[0]["detail"] == f"{tmp_path}/x"


def _listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    return server, server.getsockname()[1]


def test_network_is_refused_by_default():
    server, port = _listener()
    try:
        r = _run(code=f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
        assert r.stopped_reason == "network" and "connected" not in r.stdout
        # below the audit hook (a raw socket from a shell tool) the network namespace has no route out
        r = _run(command=f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected", limits=QUICK)
        assert "connected" not in r.stdout
    finally:
        server.close()


@pytest.mark.parametrize("allow_network", [False, True])
def test_a_unix_socket_is_refused_and_named(allow_network):
    """Even with network: a UNIX socket could reach D-Bus, docker.sock or Ray's sockets; connected pairs work."""
    path = Path(f"/tmp/vime-sandbox-test-{os.getpid()}.sock")  # where any uid may reach it, like Ray's
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    os.chmod(path, 0o777)
    limits = SandboxLimits(wall_time_s=5, allow_network=allow_network)
    try:
        r = _run(code=f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(path)!r})\nprint('connected')",
                 limits=limits)
        assert r.stopped_reason == "network" and "connected" not in r.stdout and r.exit_code == 1, r
        r = _run(code="import asyncio, socket\na, b = socket.socketpair()\na.sendall(b'pair')\nprint(b.recv(4))\n"
                      "asyncio.run(asyncio.sleep(0))", limits=limits)
        assert r.ok and r.stdout == "b'pair'\n", r
    finally:
        server.close()
        path.unlink()


def test_network_can_be_allowed():
    server, port = _listener()
    try:
        limits = SandboxLimits(wall_time_s=5, allow_network=True)
        r = _run(code=f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
                 limits=limits)
        assert r.ok and r.stdout == "connected\n", r
    finally:
        server.close()


def test_memory_limit():
    r = _run(code="x = bytearray(3 * 1024**3)", limits=SandboxLimits(wall_time_s=5, memory_mb=512))
    assert r.stopped_reason == "memory" and r.exit_code != 0


def test_output_is_capped_without_blocking():
    r = _run(code="import sys\nfor _ in range(200000):\n    sys.stdout.write('x' * 100)\nprint('end')",
             limits=SandboxLimits(wall_time_s=10, max_output_bytes=1000))
    assert len(r.stdout) == 1000 and r.stopped_reason == "output_limit" and r.exit_code == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        _run(code="1", command="true")
    with pytest.raises(ValueError, match="relative path"):
        _run(code="1", files={"../x": "no"})
    with pytest.raises(ValueError, match="sandbox must be"):
        make_sandbox("ftp://x")
    with pytest.raises(ValueError, match="positive number"):
        SandboxLimits(wall_time_s=-1)
    with pytest.raises(ValueError, match="true or false"):
        SandboxLimits.from_dict({"allow_network": "yes"})


def test_program_gets_a_minimal_environment(monkeypatch):
    monkeypatch.setenv("VIME_CONTROL_TOKEN", "secret-control-token")
    r = _run(code="import os\nprint(' '.join(sorted(os.environ)))\nprint(os.environ['HOME'] == os.getcwd())")
    names = set(r.stdout.split("\n")[0].split())
    assert r.ok and "VIME_CONTROL_TOKEN" not in names and r.stdout.split("\n")[1] == "True", r
    assert names <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE",
                     "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"} | {
        n for n in names if n.startswith("VIME_SANDBOX_")}


@needs_pid_namespace
def test_own_proc_in_the_pid_namespace():
    r = _run(code="import os\nprint(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    pid, pids = r.stdout.split(" ", 1)
    assert r.ok and int(pid) <= 3 and os.getpid() not in eval(pids) and len(eval(pids)) <= 3, r


WRITE_40MB = ("import time\nfor i in range(40):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)\n    time.sleep(0.02)\n"
              "print('wrote')")


@pytest.mark.parametrize("namespaces", [True, False], ids=["tmpfs", "size-check"])
def test_scratch_directory_is_size_limited(namespaces):
    sandbox = LocalSandbox(namespaces=namespaces, allow_weak_isolation=True)
    if namespaces and "tmpfs" not in sandbox.isolation["scratch"]:
        pytest.skip(f"no tmpfs in a mount namespace here: {sandbox.isolation['scratch']}")
    r = _run(sandbox, code=WRITE_40MB, limits=SandboxLimits(wall_time_s=5, max_scratch_mb=8))
    assert r.stopped_reason == "disk_quota" and "wrote" not in r.stdout, r
    assert _run(sandbox, code=WRITE_40MB, limits=SandboxLimits(wall_time_s=5, max_scratch_mb=64)).ok


def test_jail_runs_nothing_when_an_isolation_step_fails(tmp_path):
    """Fail closed: a step the config asks for that cannot be applied means the program never starts."""
    import json
    import subprocess
    import sys

    from vime.agents.sandbox.events import parse_jail_events
    from vime.agents.sandbox.local import _JAIL, _drain
    from vime.agents.sandbox.verdict import run_result

    marker = tmp_path / "ran"
    status_read, status_write = os.pipe()
    config = {"status_fd": status_write, "cwd": str(tmp_path), "env": {}, "rlimits": {},
              "argv": ["/bin/sh", "-c", f"touch {marker}"], "cgroup": str(tmp_path / "no-such-cgroup")}
    (tmp_path / "jail.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-S", str(_JAIL), str(tmp_path / "jail.json")], capture_output=True,
                          timeout=30, pass_fds=(status_write,))
    os.close(status_write)
    assert proc.returncode == 126 and not marker.exists()
    assert b"isolation failed, the program was not run: cgroup:" in proc.stderr
    jail = parse_jail_events(_drain(status_read))
    os.close(status_read)
    r = run_result(b"", proc.stderr, False, False, proc.returncode, False, False, False, jail, [], 0.1)
    assert r.stopped_reason == "sandbox_error" and r.exit_code is None and "cgroup" in r.violations[0]["detail"]
