"""vime on a multi-node Ray cluster: real raylets on this machine (`ray.cluster_utils.Cluster`, Ray's own way to
run several nodes on one host), each with its own object store, node id and resources, joined by the run through
--ray-address with a token only the cluster has, as on a Slurm or Kubernetes cluster started with `ray start`.

Nodes: the head (no CPUs: the driver's node, where the rollout manager and its router must run) and four
one-CPU nodes, so that the trainer and each engine get a node of their own and one node is spare.

1. disk transport (a staging directory every node reads), 3 rollouts of GRPO: while rollout 1 is held, the
   processes are where they must be (told by which raylet each descends from): the trainer on one node, the
   engine on another, the router and the rollout manager on the driver's; every weight check finds the
   trainer's log-probs in the engine (< 1e-5), and the train/rollout gap is below 1e-5. Then, while rollout 3
   is held, the trainer's node dies: the run stops within two minutes with an error that names the way back
   (`--load` of its checkpoint, saved after rollout 1). The node then comes back (a new raylet) for test 2.
2. broadcast over TCP, two engines on two more nodes, and a node that dies: while rollout 1 is held, one
   engine's node is SIGKILLed (its raylet and every process under it). The run goes on: the next update's
   group leaves the dead engine out, every trained batch is full (no failed sample), the fleet replaces the
   engine on the spare node, and once it serves (rollout 3 waits for it) the weight check compares both
   engines again, the replacement included; gaps and checks as in 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.crash_hold_plugin import FUNCTION_PATH, HERE as PLUGIN_DIR, hold_file, wait_until_held
from tests.e2e.processes import stack_pids

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
WORKER_NODES = 4
STORE = 100 * 2**20  # each node's object store


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(the Cluster, its worker nodes in order, the hold file prefix). Its nodes' processes inherit this environment: the run's hold plugin
    on the path, and Ray's token authentication with a 0600 token in a 0700 directory."""
    from ray.cluster_utils import Cluster

    from vime.driver.ray_auth import MODE_ENV, TOKEN_PATH_ENV, drop_run_token, reload_ray_auth_config, use_run_token

    assert not stack_pids(), "engine or router processes are already running"
    hold = tmp_path_factory.mktemp("multi_node") / "hold"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(PLUGIN_DIR), str(REPO), os.environ.get("PYTHONPATH", "")]))
        for name in (MODE_ENV, TOKEN_PATH_ENV, "RAY_AUTH_TOKEN"):  # whatever an earlier test left behind
            env.delenv(name, raising=False)
        # what vime does for a cluster it starts: RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH a 0600 file
        assert use_run_token() is not None
        # the manager (a Ray worker) sees the nodes' environment, not the driver's: the hold is set here
        env.setenv("VIME_TEST_HOLD", str(hold))
        env.setenv("VIME_TEST_HOLD_AT", "1,3")
        # a dead node is declared dead after 3 missed 1 s health checks (Ray's default takes ~30 s)
        cluster = Cluster(initialize_head=True, connect=False, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False, "object_store_memory": STORE,
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
        try:
            nodes = [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=STORE)
                     for _ in range(WORKER_NODES)]
            cluster.wait_for_nodes()
            yield cluster, nodes, hold
        finally:
            cluster.shutdown()
            drop_run_token()
    reload_ray_auth_config()  # this process's Ray sees the environment it had before
    assert not stack_pids(), "a process of the run outlived the cluster"


def _raylets(cluster, nodes) -> dict[int, str]:
    """raylet pid -> "head" or "node<i>" (`nodes[i]`)."""
    names = [(cluster.head_node, "head"), *((node, f"node{i}") for i, node in enumerate(nodes))]
    return {node.all_processes["raylet"][0].process.pid: name for node, name in names}


def _where(pid: int, raylets: dict[int, str]) -> str:
    """The node whose raylet `pid` descends from."""
    import psutil

    for parent in psutil.Process(pid).parents():
        if parent.pid in raylets:
            return raylets[parent.pid]
    raise AssertionError(f"process {pid} runs under no raylet of the cluster")


def _processes(marker: str) -> list[int]:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc.pid)
    return found


def _placement(raylets: dict[int, str]) -> dict[str, list[str]]:
    """role -> the nodes its processes (a server, its watchdog, its engine core) run on now."""
    return {role: sorted({_where(pid, raylets) for pid in _processes(marker)}) for role, marker in (
        ("engines", "vllm.entrypoints.openai.api_server"), ("router", "vime.engine.control.router"),
        ("trainer", "ray::TrainActor"), ("manager", "ray::RolloutManager"))}


def _kill_node(nodes, name: str) -> None:
    """SIGKILL node `name`'s raylet and every process under it, at once, as when the machine dies."""
    import psutil

    node = nodes[int(name.removeprefix("node"))]
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    for proc in [*raylet.children(recursive=True), raylet]:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def _command(cluster, out: Path, transport: str, num_rollout: int, *extra: str,
             model: Path, data: Path, engines: int = 2) -> list[str]:
    return [
        sys.executable, str(REPO / "train.py"), "--ray-address", cluster.address, "--hf-checkpoint", str(model),
        "--prompt-data", str(data), "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
        "--rm-type", "random", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--num-rollout", str(num_rollout), "--rollout-num-gpus", str(engines), "--rollout-max-response-len", "16",
        "--micro-batch-size", "8", "--lr", "1e-2", "--check-weight-update-equal",
        "--update-weight-transport", transport, "--rollout-function-path", FUNCTION_PATH,
        "--output-dir", str(out / "run"), "--vllm-enforce-eager", "--vllm-max-model-len", "256", *extra]


def _start(cmd: list[str], out: Path, hold: Path, at: tuple[int, ...]) -> tuple[subprocess.Popen, Path]:
    for rollout_id in (1, 3):
        for path in (hold_file(hold, rollout_id, 1), Path(f"{hold_file(hold, rollout_id, 1)}.reached")):
            path.unlink(missing_ok=True)
    for rollout_id in at:
        hold_file(hold, rollout_id, 1).touch()
    log = out / "run.log"
    # Ray turns a loopback --ray-address into the machine's outward address before it connects (for clusters
    # that span machines); this one listens on loopback only, where its traffic stays
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return proc, log


@contextlib.contextmanager
def _killed_if_it_fails(proc: subprocess.Popen, *holds: Path):
    """The run is killed if the block fails; its holds are released either way."""
    try:
        yield
    except BaseException:
        proc.kill()
        raise
    finally:
        for hold in holds:
            hold.unlink(missing_ok=True)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    assert "does not ask for a token" not in text  # the run joined with the cluster's token
    return text


def _trained(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "train/steps" in r]


def _check_on_policy(record: dict, engines: tuple[int, ...]) -> None:
    assert record["weight_check/max_abs_logprob_diff"] < 1e-5, record
    assert record["weight_check/engines"] in engines, record
    assert record["train_rollout_logprob_abs_diff"] < 1e-5, record
    # every trained batch is full: all 4 x 4 samples generated, none failed, all of them trained on
    assert record["rollout/num_samples"] == 16 and record["rollout/failed_samples"] == 0, record
    assert record["train/num_usable_samples"] == 16, record


def test_disk_transport_across_nodes_and_the_trainers_node_dies(cluster, tiny_qwen3, arithmetic_data, tmp_path):
    cluster, nodes, hold = cluster
    raylets = _raylets(cluster, nodes)
    later, save = hold_file(hold, 3, 1), tmp_path / "ckpt"
    # one engine: the broadcast test spreads two over two nodes
    proc, log = _start(_command(cluster, tmp_path, "disk", 4, "--update-weight-dir", str(tmp_path / "stage"),
                                "--save", str(save), "--save-interval", "2", model=tiny_qwen3,
                                data=arithmetic_data[0], engines=1), tmp_path, hold, at=(1, 3))
    with _killed_if_it_fails(proc, hold, later):
        wait_until_held(proc, hold, lambda: log.read_text()[-4000:])
        where = _placement(raylets)
        hold.unlink()
        wait_until_held(proc, later, lambda: log.read_text()[-4000:])
        _kill_node(nodes, where["trainer"][0])
        killed = time.monotonic()
        later.unlink()
        proc.wait(timeout=180)
    text = log.read_text()
    assert where["router"] == ["head"] and where["manager"] == ["head"], where  # the driver's node
    assert len(where["trainer"]) == 1 and where["trainer"][0] != "head", where
    assert len(where["engines"]) == 1 and where["engines"][0] not in {"head", where["trainer"][0]}, where
    assert "placement over 2 nodes" in text
    assert "engines ['http://127.0.0.1:" in text  # the engine's node's address (not the machine's outward one)
    records = _trained(tmp_path)
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    for r in records:
        _check_on_policy(r, engines=(1,))
    # the trainer's node lost with it: the run stops at once, saying how to resume (the checkpoint of rollout 1)
    assert proc.returncode != 0 and time.monotonic() - killed < 120, text[-4000:]
    assert "the training actors died" in text and f"--load {save} to resume" in text, text[-4000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    # the node comes back, for the next test
    lost = int(where["trainer"][0].removeprefix("node"))
    cluster.remove_node(nodes[lost], allow_graceful=False)  # what is left of it, out of the cluster's count
    nodes[lost] = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=STORE)
    cluster.wait_for_nodes()


def _wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()[-6000:]
        assert time.monotonic() < deadline, f"no {text!r} in the run's log within {timeout:.0f} s"
        time.sleep(0.5)


def test_broadcast_across_nodes_and_a_node_that_dies(cluster, tiny_qwen3, arithmetic_data, tmp_path):
    cluster, nodes, hold = cluster
    raylets = _raylets(cluster, nodes)
    later = hold_file(hold, 3, 1)
    proc, log = _start(_command(cluster, tmp_path, "broadcast", 4, "--use-fault-tolerance",
                                "--rollout-health-check-interval", "2", "--rollout-health-check-timeout", "5",
                                model=tiny_qwen3, data=arithmetic_data[0]), tmp_path, hold, at=(1, 3))
    with _killed_if_it_fails(proc, hold, later):
        wait_until_held(proc, hold, lambda: log.read_text()[-4000:])
        before = _placement(raylets)
        dead = before["engines"][0]
        _kill_node(nodes, dead)
        hold.unlink()
        wait_until_held(proc, later, lambda: log.read_text()[-4000:])
        _wait_for(proc, log, "restarted in")  # rollout 3 waits until the replacement serves
        after = _placement(raylets)
    _finish(proc, log)
    spare = {f"node{i}" for i in range(WORKER_NODES)} - set(before["engines"]) - set(before["trainer"])
    assert len(spare) == 1 and after["trainer"] == before["trainer"], (before, after)
    assert after["engines"] == sorted(set(before["engines"]) - {dead} | spare), (before, after)
    records = _trained(tmp_path)
    assert [r["rollout_id"] for r in records] == [0, 1, 2, 3]
    # the replacement boots for ~12 s from rollout 1's update on: rollout 2's check finds it only if that rollout
    # is that slow, rollout 3's (held until it serves) always does
    for r in records:
        _check_on_policy(r, engines={0: (2,), 1: (1,), 2: (1, 2), 3: (2,)}[r["rollout_id"]])
    assert sum(r.get("rollout/engine_restarts", 0) for r in records) == 1
