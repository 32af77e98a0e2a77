"""The RL trainer: what one training rank does with a rollout (hosted by the Ray actor in `vime.driver.train_group`).

It builds on `vime.trainer.megatron` (the Megatron model, HF conversion, checkpoints), which never imports it
back. `trainer.MegatronTrainer` is the rank's entry point.
"""
