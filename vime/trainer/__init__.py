"""The RL trainer: what one training rank does with a rollout (hosted by the Ray actor in `vime.ray.actor_group`).

It builds on `vime.backends.megatron_utils` (the Megatron model, HF conversion, checkpoints), which never imports it
back. `trainer.MegatronTrainer` is the rank's entry point.
"""
