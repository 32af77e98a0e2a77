"""Weight sync through files: each pipeline stage writes its layers as HF safetensors, engines reload them.

Works everywhere (CPU, GPU, engines on other machines with a shared mount). The default root on /dev/shm keeps it
in memory on one machine. Each update is a fresh private directory under the weight root (the driver's
`staging.stage_dir`) holding model-pp<stage>.safetensors files only (each stage's writer rank); the engines load
nothing else from it (`vime.engine.in_vllm.worker_extension.WeightReceiver.vime_load_weights`).
"""
