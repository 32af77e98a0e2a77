"""Make megatron-core 0.16.1 run on CPU with the gloo backend.

Megatron-core assumes CUDA in many places. `apply_cpu_compat()` patches only the CUDA entry points that
vime's training path was found to reach on CPU (model build, forward/backward, pipeline schedules, DDP with
overlapped reduce, the (distributed) optimizer, grad clipping, dist_checkpointing save/load, activation
recompute, sequence parallel), so the same Megatron code runs on a CPU-only machine. Not covered: CUDA graphs,
MoE overlap schedules, NVTX profiling, context parallel.

Its cost: the mode is entered for good in each training thread, because Megatron places tensors on
`torch.cuda.current_device()` inside the hot path too (the rotary embedding's frequencies in every forward, the
schedules' token counters, pipeline buffers, the optimizer). Measured on the 20M-parameter bench model: a
16 x 96-token forward makes 1454 torch calls through the mode at about 0.5 us each over a plain call, under a
millisecond against a forward + backward of about a second; backward kernels run in C++ and do not see it.

Who calls it: `parallel.init_parallel` inside training processes, before any model is built. It is a no-op
when CUDA is available (GPU machines run Megatron unpatched). Patches are never undone; do not call it in a
process that needs the real `torch.cuda` behaviour.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

_THREAD = threading.local()  # holds this thread's _CudaToCpuMode once entered


def _is_cuda_device(device) -> bool:
    """True for what torch reads as a CUDA device: "cuda", "cuda:0", torch.device("cuda"), a bare index."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _called_from_megatron() -> bool:
    """Whether the torch call being handled was made by megatron-core's code (torch's own frames, and those of
    other torch-function modes stacked above this one, e.g. a test's, are not the caller)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_globals.get("__name__", "").startswith("torch")
                                 or frame.f_code.co_name == "__torch_function__"):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("megatron")


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA tensor placement to the CPU.

    Megatron creates buffers with `device="cuda"`, `device=torch.cuda.current_device()` or `.cuda()` (causal
    masks, rotary frequencies, pipeline and DDP buffers, optimizer scalars); on CPU these would raise.
    Its optimizer and grad clipping also assert `param.type() == "torch.cuda.FloatTensor"`; for callers inside
    megatron `Tensor.type()` answers with the CUDA name of the same dtype.
    """

    # Only sequence parallel's backward allocates on CUDA (its gathers, reduce-scatters and grad buffers): running
    # every backward under the mode costs a Python call per torch call in it, so it is switched on for such runs.
    redirect_backward = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.autograd.backward and self.redirect_backward:
            return _backward_in_mode(self, *args, **kwargs)
        if func is torch.device and len(args) == 1 and _is_cuda_device(args[0]):  # `with torch.device(index):`
            return torch.device("cpu")  # (YaRN's rotary embedding builds its frequencies so)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda.") and _called_from_megatron():
                name = "torch.cuda." + name[len("torch."):]
            return name
        return func(*args, **kwargs)


def _backward_in_mode(mode: TorchFunctionMode, tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                      inputs=None) -> None:
    """`torch.autograd.backward` with `mode` on while autograd runs. A mode is off while it handles a call, and
    torch.autograd.backward is one, so without this the Python backward of autograd Functions would run
    unredirected; Megatron's allocate on `torch.cuda.current_device()` too (sequence parallel's gathers and
    reduce-scatters, its linear layers' grad buffers). The body is torch's own, after its torch-function check
    (which would hand the call back to the mode)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
    inputs = () if inputs is None else (inputs,) if torch.is_tensor(inputs) else tuple(inputs)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    with mode:
        _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                             inputs, allow_unreachable=True, accumulate_grad=True)


class CPURNGStatesTracker:
    """CPU stand-in for megatron's `CudaRNGStatesTracker`: named CPU generator states, same interface.

    `fork(name)` swaps the default CPU generator to the named state for the block (dropout in
    tensor-parallel regions, weight init) and restores it afterwards, like the CUDA tracker does with the
    CUDA generator.
    """

    def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _HostEvent:
    """What a `_HostStream` records: always complete."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """Stands in for `torch.cuda.Stream` on CPU, where every op has finished when it returns: nothing to order or
    wait for. (MoE's all-to-all token dispatcher creates a side stream for its device-to-host copies.)"""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_HOST_STREAM = _HostStream()


def _all_to_all_forward(ctx, group, input, output_split_sizes, input_split_sizes):
    """megatron-core's `_AllToAll.forward` with its output on the input's device. The original allocates on
    `torch.cuda.current_device()`, and its backward runs inside autograd, where the device-redirecting mode is
    off (a mode is suspended while it handles a call, here `torch.autograd.backward`)."""
    ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
    if group.size() == 1:
        return input
    input = input.contiguous()
    if output_split_sizes is None:
        output = torch.empty_like(input)
    else:
        output = input.new_empty(size=[int(sum(output_split_sizes))] + list(input.size()[1:]))
    torch.distributed.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                        input_split_sizes=input_split_sizes, group=group)
    return output


def _split_sizes_on_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's `maybe_move_tensor_to_cpu` for tensors already on the CPU: the all-to-all split sizes must
    still become numpy (torch.distributed refuses a tensor there), which the original does only for GPU ones."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


_NO_CUDA_RNG_STATE = torch.empty(0, dtype=torch.uint8)


def _get_no_cuda_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    """megatron-core's `_get_cuda_rng_state` on CPU: there is no CUDA generator to save. Activation recompute
    (`CheckpointFunction`, `CheckpointWithoutOutput`) saves the CPU state and the tracker's named states beside
    it, which is what the CPU's dropout draws from (`CPURNGStatesTracker`), so replays stay exact."""
    return _NO_CUDA_RNG_STATE


def _set_no_cuda_rng_state(new_state, device=-1, graph_safe=False) -> None:
    """megatron-core's `_set_cuda_rng_state` on CPU: nothing to restore (see `_get_no_cuda_rng_state`)."""


def redirect_backward_for_sequence_parallel() -> None:
    """A sequence-parallel model is built in this process: run backward under the CUDA-to-CPU mode too."""
    _CudaToCpuMode.redirect_backward = True


def apply_cpu_compat() -> None:
    """Patch torch.cuda and megatron-core for CPU training. No-op when CUDA is available.

    Idempotent. The process-wide patches are applied once; the device-redirecting mode, like
    `torch.set_default_device`, is per thread: call this again in any other thread that runs Megatron code
    (e.g. an async Ray actor's event-loop thread).
    """
    if torch.cuda.is_available():
        return
    _patch_process()
    if getattr(_THREAD, "mode", None) is None:
        # Tensors placed on "cuda" inside megatron land on the CPU (see _CudaToCpuMode); entered for good.
        _THREAD.mode = _CudaToCpuMode()
        _THREAD.mode.__enter__()


@functools.cache  # once per process: the patches replace module attributes of torch and megatron-core
def _patch_process() -> None:
    import megatron.core.tensor_parallel.random as mcore_random

    # Megatron passes torch.cuda.current_device() as a device; index 0 is then redirected by the mode.
    torch.cuda.current_device = lambda: 0
    # Pipeline p2p and dist_checkpointing synchronize the GPU; nothing to wait for on CPU.
    torch.cuda.synchronize = lambda device=None: None
    # MoE's token dispatcher orders its copies with a side stream; on CPU there is one, synchronous, stream.
    torch.cuda.Stream = _HostStream  # a class: other libraries annotate with `torch.cuda.Stream | None`
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    # Megatron instantiates `CudaRNGStatesTracker` by its module-level name: swap the class so that
    # model_parallel_cuda_manual_seed() and get_cuda_rng_tracker() hand out CPU generator states.
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    import megatron.core.tensor_parallel.mappings as mappings

    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_on_host  # expert parallel's all-to-all
    mappings._AllToAll.forward = staticmethod(_all_to_all_forward)
    mcore_random.CudaRNGStatesTracker = CPURNGStatesTracker
    # Activation recompute saves and restores the CUDA generator around each recomputed forward.
    mcore_random._get_cuda_rng_state = _get_no_cuda_rng_state
    mcore_random._set_cuda_rng_state = _set_no_cuda_rng_state
    mcore_random.initialize_rng_tracker(force_reset=True)
