"""Synthetic inputs built locally, with no download: tiny HF models with their own tokenizer (`tiny_model`) and
small tasks with checkable answers (`arithmetic_data`, `task_data`), for the quickstart, examples, tests and
benchmarks. Nothing else in vime imports this package."""
