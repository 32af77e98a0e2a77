"""Routed experts from a CPU engine: which experts each token of a request was routed to, returned by vLLM's own
API (`routed_experts` of a generate choice: base64 `.npy`, [tokens - 1, layers, top-k]).

vLLM 0.32 captures them only in its V2 model runner (`--enable-return-routed-experts` with
VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton: a GPU. On CPU vime captures them itself:

- the worker (V1 model runner): each MoE router hands its top-k ids to `StepCapture.capture` (vLLM's own
  `bind_routed_experts_capturer` binds them); after the forward they are cut per request (`by_request`) and
  travel to the scheduler with the step's `ModelRunnerOutput`;
- the scheduler: `RoutingStore` places them at their token positions; when a request finishes, its last output
  carries them as `EngineCoreOutput.routed_experts`, which vLLM's output processor and servers pass to the
  client unchanged.

Tokens served from the prefix cache are not forwarded, so they would have no routing: vime starts such engines
with prefix caching off (`engine.engine_command`). Installed by the general plugin (`general_plugin.configure`)
when CAPTURE_ENV is set. Each side's state lives on the vLLM object it serves: the worker's `StepCapture` on its
model runner, the `RoutingStore` on the scheduler.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

from vime.engine.protocol.names import CAPTURE_ENV

logger = logging.getLogger(__name__)


class StepCapture:
    """Worker side: the top-k ids every MoE layer chose in the forward in progress, then per request."""

    def __init__(self, num_layers: int, topk: int, num_experts: int):
        self.num_layers, self.topk = num_layers, topk
        self.dtype = np.uint8 if num_experts <= 256 else np.uint16  # what vLLM's own capture returns
        self.step: dict[int, np.ndarray] = {}  # layer -> [step tokens, top-k]

    def capture(self, layer_id: int, topk_ids) -> None:
        self.step[layer_id] = topk_ids.detach().cpu().numpy()

    def by_request(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray) -> dict:
        """{request id: (first position, [tokens, layers, top-k] rows)} of the forward just run, whose request i
        had rows query_start_loc[i]:query_start_loc[i + 1] at consecutive token positions from `positions`."""
        step, self.step = self.step, {}
        if not step:
            return {}
        n = len(positions)
        table = np.zeros((n, self.num_layers, self.topk), dtype=self.dtype)
        for layer, ids in step.items():
            table[:, layer] = ids[:n]
        out = {}
        for i, req_id in enumerate(req_ids):
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            if end > start:
                out[req_id] = (int(positions[start]), table[start:end])
        return out


class RoutingStore:
    """Scheduler side: per request, the expert ids of every forwarded token, [positions, layers, top-k]."""

    def __init__(self):
        self.rows: dict[str, np.ndarray] = {}
        self.filled: dict[str, int] = {}  # how many positions of each request have routing
        self.finished: dict[str, np.ndarray] = {}  # freed requests' rows, until their last output takes them

    def add(self, req_id: str, first: int, rows: np.ndarray) -> None:
        end = first + len(rows)
        have = self.rows.get(req_id)
        if have is None or len(have) < end:
            grown = np.zeros((max(end, 2 * len(have) if have is not None else end), *rows.shape[1:]), dtype=rows.dtype)
            if have is not None:
                grown[:len(have)] = have
            have = self.rows[req_id] = grown
        have[first:end] = rows
        self.filled[req_id] = max(self.filled.get(req_id, 0), end)

    def finish(self, req_id: str) -> None:
        rows = self.rows.pop(req_id, None)
        if rows is not None:
            self.finished[req_id] = rows[:self.filled.pop(req_id)]

    def take(self, req_id: str) -> np.ndarray | None:
        return self.finished.pop(req_id, None)


def install() -> None:
    """Patch the V1 model runner and the scheduler of this process (idempotent). The worker hands each step's
    rows to the scheduler in the field vLLM's own capture uses, `ModelRunnerOutput.aux_output_connector_output`
    (which the scheduler reads only with vLLM's own connector, absent here)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._model_forward, "vime_capture", False):
        return
    forward, sample = GPUModelRunner._model_forward, GPUModelRunner.sample_tokens
    free, update = Scheduler._free_request, Scheduler.update_from_output

    @functools.wraps(forward)
    def _model_forward(self, *args, **kwargs):
        capture = _capture_for(self)
        output = forward(self, *args, **kwargs)
        num_reqs = self.input_batch.num_reqs
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if num_reqs and positions is not None:
            starts = self.query_start_loc.cpu[:num_reqs + 1].numpy()
            self.vime_routing = capture.by_request(list(self.input_batch.req_ids[:num_reqs]), starts,
                                                   positions.cpu().numpy()[:int(starts[-1])])
        else:
            capture.step = {}
        return output

    @functools.wraps(sample)
    def sample_tokens(self, *args, **kwargs):
        output = sample(self, *args, **kwargs)
        routing, self.vime_routing = getattr(self, "vime_routing", None), None
        if routing:
            if isinstance(output, AsyncModelRunnerOutput):
                get_output = output.get_output

                def with_routing():
                    result = get_output()
                    result.aux_output_connector_output = routing
                    return result

                output.get_output = with_routing
            elif isinstance(output, ModelRunnerOutput):
                output.aux_output_connector_output = routing
        return output

    def _free_request(self, request, *args, **kwargs):
        _store_of(self).finish(request.request_id)
        return free(self, request, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        store = _store_of(self)
        for req_id, (first, rows) in (getattr(model_runner_output, "aux_output_connector_output", None) or {}).items():
            if isinstance(rows, np.ndarray):  # vime's (first position, rows), not vLLM's own connector's
                store.add(req_id, first, rows)
        outputs = update(self, scheduler_output, model_runner_output, *args, **kwargs)
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                if out.finish_reason is not None and out.routed_experts is None:
                    out.routed_experts = store.take(out.request_id)
        store.finished.clear()  # freed without an output (aborted): nobody will ask
        return outputs

    _model_forward.vime_capture = True
    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner.sample_tokens = sample_tokens
    Scheduler._free_request = _free_request
    Scheduler.update_from_output = update_from_output
    logger.info("vime: capturing routed experts in this engine (%s)", CAPTURE_ENV)


def _capture_for(runner) -> StepCapture:
    """The model runner's capture, made (and the model's routers bound to it) on its first forward."""
    capture = runner.__dict__.get("vime_step_capture")
    if capture is None:
        config = runner.vllm_config.model_config
        capture = runner.vime_step_capture = StepCapture(config.get_total_num_hidden_layers(),
                                                         config.get_num_experts_per_tok(), config.get_num_experts())
    model = runner.get_model()
    if not getattr(model, "vime_routing_bound", False):
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        bind_routed_experts_capturer(model, capture)
        model.vime_routing_bound = True
    return capture


def _store_of(scheduler) -> RoutingStore:
    """The scheduler's store of routed experts, made at its first use."""
    store = scheduler.__dict__.get("vime_routing_store")
    if store is None:
        store = scheduler.vime_routing_store = RoutingStore()
    return store


def enabled() -> bool:
    return os.environ.get(CAPTURE_ENV) == "1"
