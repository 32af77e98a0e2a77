"""The engine half of LoRA adapter sync: each new adapter version loaded into a running engine under one name.

    POST /vime/update_weights {"method": "vime.load_lora_adapter", "kwargs": {"name": "policy", "path": DIR}, ...}

Runs inside the engine's HTTP server, from vime's update route (`endpoint.run_update`), while the scheduler is
paused: the adapter in DIR (PEFT's adapter_config.json and adapter_model.safetensors, written by the trainers) is
loaded by every worker in place of the previous version, under the same LoRA id, and requests naming `name` are
served with it from then on. The base weights never change.

Why not vLLM's own `/v1/load_lora_adapter`: its in-place reload keeps `load_inplace=True` on the request it hands
to every later generation, and vLLM's workers then read the adapter from disk again at every forward step. Here
the workers load it once (`add_lora` with load_inplace), and later requests carry a plain request for the same
id, which the workers find already loaded. The name may be the base model's served name ("policy"): vLLM looks
a request's model up among the adapters first, so rollouts, the agents' endpoint and the weight check ask for
"policy" whether or not the run trains LoRA.
"""

from __future__ import annotations

import re

LOAD_ADAPTER = "vime.load_lora_adapter"  # the update route's own load, not a worker method
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a directory holds these and nothing else
_ADAPTER_FILE = re.compile("|".join(re.escape(name) for name in ADAPTER_FILES))


def adapter_load_call(name: str, path: str) -> tuple[str, dict[str, str]]:
    """The update call that serves the adapter in `path` as model `name`."""
    return LOAD_ADAPTER, {"name": name, "path": path}


async def load_adapter(models, engine, kwargs: dict[str, str]) -> dict:
    """Load the adapter `kwargs["path"]` into every worker of `engine` (vLLM's AsyncLLM) and serve it as
    `kwargs["name"]` through `models` (the server's OpenAIServingModels). The directory must lie under the
    engine's weight root and hold the two PEFT files only (never a pickled adapter_model.bin)."""
    from vllm.lora.request import LoRARequest

    from vime.backends.vllm_utils.weight_loading import update_files

    name, path = kwargs.get("name"), kwargs.get("path")
    if not name or not path:
        raise ValueError(f"{LOAD_ADAPTER} needs 'name' and 'path', got {sorted(kwargs)}")
    found = {f.name for f in update_files(path, _ADAPTER_FILE)}
    if found != set(ADAPTER_FILES):
        raise FileNotFoundError(f"LoRA adapter {path}: needs {', '.join(ADAPTER_FILES)}; found {sorted(found)}")
    current = models.lora_requests.get(name)
    lora_id = current.lora_int_id if current is not None else models.lora_id_counter.inc(1)
    await engine.add_lora(LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=True))
    models.lora_requests[name] = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
    return {"adapter": name, "lora_id": lora_id}
