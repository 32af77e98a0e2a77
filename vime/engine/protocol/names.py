"""The names by which vime reaches its code inside vLLM, and the switches that code reads (strings only: the driver
reads them on its engines' start-up path, which waits for no torch)."""

from __future__ import annotations

PLUGIN_NAME = "vime"  # both entry points' name (pyproject.toml); VLLM_PLUGINS must list it (`engine.plugin_allowlist`)
# --worker-extension-cls of the engines vime starts
WORKER_EXTENSION = "vime.engine.in_vllm.worker_extension.WeightReceiver"
UPDATE_ROUTE = "/vime/update_weights"  # the endpoint plugin's one-call weight update (`in_vllm.endpoint_plugin`)
LOAD_ADAPTER = "vime.load_lora_adapter"  # an update "method" the route runs itself, not a worker method

# the general plugin's switches (`in_vllm.general_plugin`), set in the environment of the engines vime starts
IDLE_SPIN_ENV = "VIME_ENGINE_IDLE_SPIN_S"  # seconds a worker busy-waits after a message (CPU engines)
CORE_FORK_ENV = "VIME_ENGINE_CORE_FORK"  # "1": fork the engine core from the API server
CAPTURE_ENV = "VIME_CAPTURE_ROUTED_EXPERTS"  # "1": capture routed experts in a CPU engine (`in_vllm.routing_capture`)

# Which key each route of an engine's server asks for (`in_vllm.route_auth`); the router gate passes on the same
# generation routes. Anything else (control, profiling, /metrics, any route a later vLLM adds) takes the control
# token only: an explicit list, since a prefix would open the next vLLM's new routes to the serving key.
PUBLIC_PATHS = frozenset({"/health"})
# what generation needs (vime's rollouts, agents' OpenAI / Anthropic calls, teacher scoring) and reads nothing else
SERVING_PATHS = frozenset({
    "/inference/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/completions/render", "/v1/chat/completions/render", "/v1/responses/render",
    "/v1/messages/render", "/v1/models", "/tokenize", "/detokenize", "/v1/embeddings", "/pooling", "/classify",
    "/score", "/rerank", "/v1/score", "/v1/rerank", "/v2/embed", "/v2/rerank",
})
