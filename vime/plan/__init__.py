"""`python -m vime.plan <train.py flags> --gpu-memory-gib 80 [--json]`: each role's memory on one device and the
step's counted FLOPs, before anything starts (`memory`: the arithmetic; `run_plan`: from a run's flags)."""
