"""Weight sync of what changed: like `disk`, but only the tensors whose bytes changed since the last sync.

    python train.py --update-weight-transport delta [--update-weight-dir /shared/mount] ...

For engines behind a slow link (a shared mount across sites): each training writer keeps a SHA-1 digest of the
bytes of every HF tensor it last sent and writes only the changed ones; the engines reload that partial directory.
(SHA-1 as a content fingerprint, not for security: with SHA-NI it ran at 1.25 GB/s here, blake2b at 0.49.)

What vLLM 0.32 does with a partial set (checked on the CPU build): `reload_weights(weights_path=DIR)` reloads
layer by layer, and a layer that receives nothing keeps its current weights. A layer that receives only part of
its tensors is rebuilt with the missing part uninitialised (NaN outputs seen for q_proj alone into the fused
qkv_proj, and gate_proj alone into gate_up_proj). So the unit of change is vLLM's layer: when any tensor of a
fused group (q/k/v, gate/up, the experts of an MoE layer) changed, the whole group is sent (`load_unit`).

The digests describe what the engines hold, so a new engine set (new group key from the driver) starts over
with a full sync; an update that fails half way leaves them wrong, which only matters if the run goes on.
"""
