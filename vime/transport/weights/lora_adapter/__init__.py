"""LoRA weight sync: only the adapters travel, as a PEFT adapter the engines serve through vLLM's LoRA support.

The base never changes during a LoRA run, so the engines keep it and each update is a fresh private directory
under the weight root holding one PEFT adapter per adapter of the run (`<dir>/<name>/`: adapter_config.json and
adapter_model.safetensors, each tensor gathered over tensor parallel, the pipeline stages joined:
`hf_checkpoint.save_peft_adapter`). Every engine loads them in place of their previous versions under their names
(`vime.engine.in_vllm.lora_serving`, inside vime's update route): "policy" for a run's one adapter, so rollouts keep
asking for it, or each --lora-adapters name. The engines are started with LoRA enabled for it
(`engine.lora_engine_options`). Selected by --lora-sync adapter (the default of a LoRA run whose engines vime
starts), never by --update-weight-transport.
"""
