"""Weight sync in memory: the training writers broadcast HF tensors over a process group the engines joined.

    python train.py --update-weight-transport broadcast [--update-weight-buffer-size BYTES] ...

The group, its members' ranks and the wire protocol, which writers and engines run alike:
`vime.engine.protocol.weight_broadcast`. The driver hands out a group key per engine set (`driver`); every member
keeps the group it built under a key and rebuilds it when an update carries another one. The engine side
(`vime.engine.in_vllm.worker_extension`) feeds the tensors, as they arrive, to vLLM's
`reload_weights(weights_iterator=...)`: on CPU the linear weights are repacked after loading, so writing into the
parameters would not update anything.
"""
