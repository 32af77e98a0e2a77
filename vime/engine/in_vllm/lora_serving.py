"""The engine half of LoRA adapter sync: each new version of the run's adapters loaded into a running engine.

    POST /vime/update_weights {"method": "vime.load_lora_adapter", "kwargs": {NAME: DIR, ...}, ...}

Runs inside the engine's HTTP server, from vime's update route (`endpoint_plugin.run_update`), while the
scheduler is paused: each adapter NAME in its DIR (PEFT's adapter_config.json and adapter_model.safetensors,
written by the trainers) is loaded by every worker in place of its previous version, under the same LoRA id, and
requests naming NAME are served with it from then on. The base weights never change. An update writes one
directory holding a subdirectory per adapter (the driver's `weight_transport.lora_adapter.driver.adapter_dirs` reads it
back).

Why not vLLM's own `/v1/load_lora_adapter`: its in-place reload keeps `load_inplace=True` on the request it hands
to every later generation, and vLLM's workers then read the adapter from disk again at every forward step. Here
the workers load it once (`add_lora` with load_inplace), and later requests carry a plain request for the same
id, which the workers find already loaded. A name may be the base model's served name ("policy": the one adapter
of a run without --lora-adapters): vLLM looks a request's model up among the adapters first, so rollouts, the
agents' endpoint and the weight check ask for "policy" whether or not the run trains LoRA.
"""

from __future__ import annotations

import re

from vime.engine.protocol.names import LOAD_ADAPTER
from vime.engine.protocol.weight_files import ADAPTER_FILES

_ADAPTER_FILE = re.compile("|".join(re.escape(name) for name in ADAPTER_FILES))  # a directory holds these only


async def load_adapter(models, engine, adapters: dict[str, str]) -> dict:
    """Load each adapter directory of `adapters` ({name: directory}) into every worker of `engine` (vLLM's
    AsyncLLM) and serve it as `name` through `models` (the server's OpenAIServingModels). A directory must lie
    under the engine's weight root and hold the two PEFT files only (never a pickled adapter_model.bin); all are
    checked before any is loaded."""
    from vllm.lora.request import LoRARequest

    from vime.engine.in_vllm.weight_loading import update_files

    if not adapters:
        raise ValueError(f"{LOAD_ADAPTER} needs {{adapter name: directory}}, got nothing")
    for name, path in adapters.items():
        found = {f.name for f in update_files(path, _ADAPTER_FILE)}
        if found != set(ADAPTER_FILES):
            raise FileNotFoundError(f"LoRA adapter {name} in {path}: needs {', '.join(ADAPTER_FILES)}; found "
                                    f"{sorted(found)}")
    loaded = {}
    for name, path in adapters.items():
        current = models.lora_requests.get(name)
        lora_id = current.lora_int_id if current is not None else models.lora_id_counter.inc(1)
        await engine.add_lora(LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=True))
        models.lora_requests[name] = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
        loaded[name] = lora_id
    return {"adapters": loaded}
