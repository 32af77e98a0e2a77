"""Code that runs inside vLLM's processes: the API server, the engine core and the workers of every engine vime
starts. vLLM loads it by name, never through an import from vime:

- `general_plugin.configure` (entry point `vllm.general_plugins: vime`, every process of an engine): CPU fixes
  (`cpu_rope`, `cpu_sampler`), the workers' idle-spin cap, the engine core's fork, routed-expert capture
  (`routing_capture`);
- `endpoint_plugin.VimeEndpoints` (entry point `vllm.endpoint_plugins: vime`, the API server): the one-call
  weight update route and the run-token middleware (`route_auth`), LoRA adapter loads (`lora_serving`);
- `worker_extension.WeightReceiver` (`--worker-extension-cls`, the workers): the engine half of every weight
  transport (`weight_loading`, `cuda_ipc`).

Import rule (tests/unit/test_layering.py): modules here import only `vime.utils`, `vime.engine.protocol` (the
names and wire formats both sides share) and each other; no module outside this package imports it. The driver
names it in strings only: pyproject.toml's entry points and `engine.protocol.names.WORKER_EXTENSION`.
"""
