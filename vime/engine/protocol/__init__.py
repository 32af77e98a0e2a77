"""What vime and its code inside vLLM's processes (`vime.engine.in_vllm`) agree on: the one part of vime both sides
import.

- `names`: how vLLM finds vime's code (plugin name, worker extension class), the update route, the environment
  switches of the general plugin, which routes take which key;
- `weight_files`: the weight root engines may read from, and the file names of an update directory;
- `weight_broadcast`: the in-memory weight broadcast, run by the training writers and the engines' workers alike;
- `ipc_codec`: CUDA IPC handles as JSON, written by a training writer and read by an engine's worker.

Imports only `vime.utils` and itself (tests/unit/test_layering.py).
"""
