"""Weight sync for colocated GPUs: engines read the trainer's weight tensors straight from its GPU memory.

    python train.py --colocate --update-weight-transport cuda_ipc ...

The writer rank of each pipeline stage exports a CUDA IPC handle per HF-named tensor (torch's own
`reduce_tensor`) into a small file; every engine worker on the same GPU opens the handles and feeds the tensors to
`reload_weights` (`WeightReceiver.vime_load_ipc_weights`), which copies them into the engine's own weights. GPU
only: on CPU use `disk` or `broadcast`. The files are JSON: each tensor's arguments to torch's
`rebuild_cuda_tensor` as plain data (handles as base64, dtypes and the few classes torch puts there by name), so
reading one runs no code (`vime.engine.protocol.ipc_codec`). They live in a private directory of their own under
the weight root, named stage_<stage>.json (the engine's reader, `vime.engine.in_vllm.cuda_ipc`, reads nothing else, from
nowhere else), and are removed after each update.

Memory: the writer keeps the exported tensors (`keepalive`) until `release`: at its next `send` (before the new
copies are made) or when the trainer offloads (`TrainActor.offload`, after the update). Torch counts one consumer
per export (the producer's reference count starts at 1, each process that maps the tensor takes 1 when it lets
go; a count that is not back at 0 keeps the memory in the producer's "limbo" for good), so with several engines
each gets exports of its own, in engine_<i>/ of the update directory.
"""
