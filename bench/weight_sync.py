"""Weight-sync latency: one full update (pause -> send -> apply -> reset cache -> version -> resume) from the real
Megatron trainer into one running vLLM engine, over the disk path (/dev/shm) and the in-memory broadcast path,
each against a plain copy of the same bytes (every tensor written to one /dev/shm file and read back).

    .venv/bin/python bench/weight_sync.py [--sizes 1M 20M 100M --repeats 3]

Prints, per model size, the median time of the plain copy and, per path, of the whole update as a ratio to the
copy (target <= 3x), with its parts: the trainer's send (disk; broadcast overlaps it with the load), the engine's
load and the engine's control steps (pause, prefix-cache reset, version, resume: one HTTP call per engine).
One engine at a time (started with vime's worker extension, float32, eager).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name -> tiny_model shape (qwen3, vocab 512, head_dim 64 except the smallest's 32)
SIZES = {
    "1M": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "20M": dict(hidden_size=512, num_layers=5, num_heads=8, num_kv_heads=4, intermediate_size=2048),
    "100M": dict(hidden_size=1024, num_layers=6, num_heads=16, num_kv_heads=8, intermediate_size=4352),
}


def update_once(driver, sender, trainer, url: str, token, version: int) -> dict[str, float]:
    """One update as `WeightSync.update` runs it, without Ray (`driver` and `sender`: the transport's driver and
    training-rank halves, both kept for the run; `token`: the engine's `RunToken`): seconds of the whole update,
    of the trainer's send, and of the engine's load and of its control steps (pause, cache reset, version, resume)
    as the engine timed them; the bytes of the update directory (NaN for a transport that writes none)."""
    from vime.engine.control import client
    from vime.utils.misc import find_free_port

    start = time.perf_counter()
    driver.connect([url], lambda: ("127.0.0.1", find_free_port()))
    handle = driver.prepare(version)

    def load() -> dict:
        return client.update_weights_all(token, [url], driver.load_calls([url], handle), version)[0]["timings"]

    if driver.concurrent:  # one collective: the send and the load overlap
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(trainer.send_weights, sender, handle)
            timings = load()
            sending.result()
        send = float("nan")
    else:
        trainer.send_weights(sender, handle)
        send = time.perf_counter() - start
        timings = load()
    sent = sum(f.stat().st_size for f in Path(handle).rglob("*") if f.is_file()) if isinstance(handle, str) \
        else float("nan")
    driver.cleanup(handle)
    return {"update": time.perf_counter() - start, "send": send, "load": timings["load_s"],
            "control": timings["pause_s"] + timings["finish_s"], "bytes": sent}


def plain_copy(trainer) -> tuple[float, int]:
    """Seconds to write every tensor's bytes to one /dev/shm file and read them back into tensors; bytes."""
    import torch

    tensors = [t.detach().contiguous() for _, t in trainer.hf_weights()]
    path = Path("/dev/shm") / f"vime_bench_copy_{os.getpid()}"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors:
            f.write(t.view(-1).view(torch.uint8).numpy())
    with open(path, "rb") as f:
        for t in tensors:
            out = torch.empty_like(t)
            f.readinto(out.view(-1).view(torch.uint8).numpy())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed, sum(t.numel() * t.element_size() for t in tensors)


def bench_size(label: str, shape: dict, work: Path, repeats: int) -> dict:
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer
    from vime.engine.control.engine import VLLMEngine
    from vime.transport.weights import make_driver, make_sender
    from vime.transport.weights.base import DriverSetup
    from vime.synthetic.tiny_model import build_tiny_model
    from vime.arguments import parse_args
    from vime.utils.auth import RunToken

    model = build_tiny_model(work / label, arch="qwen3", **shape)
    args = parse_args([
        "--hf-checkpoint", str(model), "--debug-train-only", "--load-debug-rollout-data", "unused_{rollout_id}",
        "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "1",
        "--update-weight-transport", "broadcast", "--output-dir", str(work / f"{label}_out"),
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "256"])
    token = RunToken.new()
    engine = VLLMEngine(args, 0, str(work), token)
    with ThreadPoolExecutor(1) as pool:
        booting = pool.submit(engine.start)
        try:
            trainer = MegatronTrainer(args)
            params = sum(t.numel() for _, t in trainer.hf_weights())
            url = booting.result()
            times = {"copy": []}
            setup = DriverSetup.of(args)
            halves = {name: (make_driver(name, setup), make_sender(name)) for name in ("disk", "broadcast")}
            version = 0
            for round_ in range(repeats + 1):  # the first round warms up (and builds the broadcast group)
                for name in ("disk", "broadcast"):
                    elapsed, nbytes = plain_copy(trainer)  # interleaved: the copy sees the same machine state
                    version += 1
                    update = update_once(*halves[name], trainer, url, token, version)
                    if round_ == 0:
                        continue
                    times["copy"].append(elapsed)
                    for part, seconds in update.items():
                        times.setdefault(f"{name}_{part}", []).append(seconds)
            halves["broadcast"][1].close()
            destroy_parallel()
        finally:
            try:
                booting.result()
            except Exception:
                pass
            engine.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"size": label, "params": params, "bytes": nbytes, **med}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--repeats", type=int, default=5, help="Timed rounds after one warm-up round (default: 5).")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vime_bench_sync_"))
    rows = []
    for label in a.sizes:
        try:
            row = bench_size(label, SIZES[label], work, a.repeats)
        finally:
            shutil.rmtree(work / label, ignore_errors=True)  # up to 400 MB per model
        rows.append(row)
        print(f"{row['size']:>5} {row['params'] / 1e6:6.1f}M params {row['bytes'] / 2**20:6.1f} MiB | "
              f"plain /dev/shm copy {row['copy'] * 1e3:7.1f} ms", flush=True)
        for name in ("disk", "broadcast"):
            send = "overlapped" if math.isnan(row[f"{name}_send"]) else f"{row[f'{name}_send'] * 1e3:.1f} ms"
            print(f"      {name:>9}: update {row[f'{name}_update'] * 1e3:7.1f} ms "
                  f"({row[f'{name}_update'] / row['copy']:5.2f}x copy) | send {send}, engine load "
                  f"{row[f'{name}_load'] * 1e3:.1f} ms, engine control {row[f'{name}_control'] * 1e3:.1f} ms",
                  flush=True)
    worst = max(max(r["disk_update"], r["broadcast_update"]) / r["copy"] for r in rows)
    print(f"worst update / copy ratio {worst:.2f}x (target <= 3x)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
