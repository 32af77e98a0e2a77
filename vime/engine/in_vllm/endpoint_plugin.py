"""vime's route in every engine's HTTP server: a whole weight update in one call (a vLLM endpoint plugin).

    POST /vime/update_weights  {"method": "reload_weights", "kwargs": {...}, "version": "3", "pause_mode": "wait"}

Runs, inside the server process: pause the scheduler (`pause_mode`: in-flight requests finish first, or are
kept, or aborted) -> the worker method `method(**kwargs)` on every worker (the transport's load; skipped when
`method` is null; `lora_serving` for a LoRA adapter) -> reset the prefix cache -> set the weight version ->
resume. Returns {"results": [one per worker], "timings": {"pause_s", "load_s", "finish_s"}}. If the load fails
the engine stays paused (it must not serve half-loaded weights) and the answer is HTTP 500 naming the error.

The same steps as five separate control routes cost an HTTP round trip each, and vLLM's `/pause` adds a fixed
20 ms sleep (for the ordering of outputs only); one update of a small model took 60-90 ms that way.

Registered as the `vllm.endpoint_plugins` entry point `vime` (pyproject.toml); vLLM loads endpoint plugins only
when named in VLLM_PLUGINS, which `engine.engine_env` sets (the name and the route: `vime.engine.protocol.names`).
Engines started without it (external engines) get the same steps as separate calls (`client.update_weights_each`).

The plugin also puts `route_auth.RunTokenMiddleware` in front of every route of the server when it was given the
run's control token (a vime engine: the token file its environment names, `auth.token_from_environment`): this
route, like vLLM's control routes, runs worker methods.
"""

# No `from __future__ import annotations`: FastAPI reads the route's parameter annotations (`Request`) at runtime.
import time

from vime.engine.protocol.names import LOAD_ADAPTER, PLUGIN_NAME, UPDATE_ROUTE


class VimeEndpoints:
    """The `vllm.endpoint_plugins` entry point: `attach_router` adds the route, `init_state` needs nothing."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        from fastapi import APIRouter, Request
        from fastapi.responses import JSONResponse

        router = APIRouter()

        @router.post(UPDATE_ROUTE)
        async def update_weights(raw_request: Request) -> JSONResponse:
            try:
                body = await raw_request.json()
                method, kwargs, version, mode = _parse(body)
            except ValueError as e:
                return JSONResponse({"error": f"{UPDATE_ROUTE}: {e}"}, status_code=400)
            try:
                state = raw_request.app.state
                answer = await run_update(state.engine_client, method, kwargs, version, mode,
                                          getattr(state, "openai_serving_models", None))
            except Exception as e:  # noqa: BLE001 - the caller gets the reason
                return JSONResponse({"error": f"{UPDATE_ROUTE}: {e}"}, status_code=500)
            return JSONResponse(answer)

        app.include_router(router)
        require_run_token(app)

    async def init_state(self, engine_client, state, args) -> None:
        pass


def require_run_token(app) -> None:
    """Every route but /health asks for the run's keys (`route_auth`), when the server was given a token (a token
    file it cannot read safely raises: the server must not start unguarded)."""
    from vime.engine.in_vllm.route_auth import RunTokenMiddleware
    from vime.utils.auth import serving_key, token_from_environment

    token = token_from_environment()
    if token is not None:  # an engine vime did not start: `VLLMEngine.start` refuses to serve without it
        app.add_middleware(RunTokenMiddleware, control_token=token, serving_key=serving_key(token))


def _parse(body) -> tuple[str | None, dict, str, str]:
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    method, kwargs, version = body.get("method"), body.get("kwargs") or {}, body.get("version")
    mode = body.get("pause_mode", "wait")
    if method is not None and not isinstance(method, str):
        raise ValueError(f"'method' must be a string or null, got {method!r}")
    if not isinstance(kwargs, dict) or not all(isinstance(v, str) for v in kwargs.values()):
        raise ValueError("'kwargs' must map names to strings (what /collective_rpc passes too)")
    if not isinstance(version, str):
        raise ValueError(f"'version' must be a string, got {version!r}")
    if mode not in ("wait", "keep", "abort"):
        raise ValueError(f"'pause_mode' must be wait, keep or abort, got {mode!r}")
    return method, kwargs, version, mode


async def run_update(engine, method: str | None, kwargs: dict, version: str, mode: str, models=None) -> dict:
    """Pause -> load -> reset prefix cache -> version -> resume on one engine client (AsyncLLM). The load is the
    worker method `method`, or, for `LOAD_ADAPTER`, a LoRA adapter served through `models` (the server's
    OpenAIServingModels)."""
    from vime.engine.in_vllm.lora_serving import load_adapter

    start = time.perf_counter()
    core = getattr(engine, "engine_core", None)
    if hasattr(core, "pause_scheduler_async"):  # what pause_generation does, without its cosmetic sleep
        await core.pause_scheduler_async(mode=mode, clear_cache=False)
    else:
        await engine.pause_generation(mode=mode, clear_cache=False)
    paused = time.perf_counter()
    try:
        if method == LOAD_ADAPTER:
            if models is None:
                raise RuntimeError("this server serves no OpenAI models to add an adapter to")
            results = [await load_adapter(models, engine, kwargs)]
        else:
            results = await engine.collective_rpc(method, kwargs=kwargs) if method else []
    except Exception as e:
        raise RuntimeError(f"worker method {method!r} failed, the engine stays paused: {type(e).__name__}: {e}") \
            from e
    loaded = time.perf_counter()
    # requests kept across the update (pause_mode "keep") are preempted: their KV is recomputed under the new
    # weights when they resume, so every token sampled after the update comes from the new policy on its whole
    # context (a kept cache would mix old-weight keys into it); without running requests this is the plain reset
    if not await engine.reset_prefix_cache(reset_running_requests=mode == "keep"):
        raise RuntimeError("the prefix cache could not be reset after the load, the engine stays paused (cached "
                           "prefixes of the old weights must not be served)")
    await engine.update_weight_version(version)
    await engine.resume_generation()
    return {"results": [r if r is None or isinstance(r, (dict, list)) else str(r) for r in results or []],
            "timings": {"pause_s": paused - start, "load_s": loaded - paused,
                        "finish_s": time.perf_counter() - loaded}}
