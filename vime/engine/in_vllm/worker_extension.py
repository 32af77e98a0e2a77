"""The engine side of every weight transport: methods vime adds to every vLLM worker
(`--worker-extension-cls vime.engine.in_vllm.worker_extension.WeightReceiver`:
`engine.protocol.names.WORKER_EXTENSION`).

vLLM mixes this class into its worker class, so `self` is the worker (`self.reload_weights`, `self.rank`,
`self.device`). Called through the dev-mode `/collective_rpc` route (or vime's `/vime/update_weights`), which pass
only string arguments. `engine_command` adds the flag unless the user names another extension class.

Every method loads through `_vime_load`: `weight_loading.load_in_place` where it applies (unquantized dense models on
CPU), else vLLM's `reload_weights`. Each returns what it loaded and whether in place. A method that takes a path
reads only an update directory under the engine's weight root, and in it only the writer's files
(`weight_loading.update_files`): the path comes from an HTTP request. Nothing read is unpickled.
"""

from __future__ import annotations

import torch


class WeightReceiver:
    def vime_receive_weights(self, key: str, master_addr: str, master_port: str, rank_offset: str, world_size: str,
                             num_senders: str, bucket_bytes: str) -> dict:
        """Join (or reuse) the weight group `key` and reload the weights the training writers broadcast.

        Blocks until every member has joined and every writer has sent; see
        `vime.engine.protocol.weight_broadcast` for the protocol. Returns {"tensors", "bytes"} received and
        "in_place"."""
        from vime.engine.protocol.weight_broadcast import broadcast_weights, group_backend, join_group

        cache = self.__dict__.setdefault("_vime_weight_group", {})
        device = getattr(self, "device", None) or torch.device("cpu")  # the vLLM worker's: decided here
        pg = join_group(cache, key, master_addr, int(master_port), int(rank_offset) + self.rank, int(world_size),
                        group_backend(device))
        received = broadcast_weights(pg, int(num_senders), int(bucket_bytes), device)
        stats = {"tensors": 0, "bytes": 0}

        def counted():
            for name, tensor in received:
                stats["tensors"] += 1
                stats["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor

        tensors = counted()
        stats["in_place"] = self._vime_load(tensors)
        for _ in tensors:  # a loader that stopped early must not leave the group's broadcasts half done
            pass
        return stats

    def vime_load_weights(self, path: str) -> dict:
        """Load the model-pp<stage>.safetensors files of update directory `path` (what the disk and delta
        transports write; it must be under the weight root and hold nothing else)."""
        from safetensors import safe_open

        from vime.engine.protocol.weight_files import STAGE_FILE
        from vime.engine.in_vllm.weight_loading import update_files

        files = update_files(path, STAGE_FILE)
        stats = {"tensors": 0}

        def tensors():
            for file in files:
                with safe_open(str(file), "pt", device="cpu") as f:
                    for name in f.keys():
                        stats["tensors"] += 1
                        yield name, f.get_tensor(name)

        stats["in_place"] = self._vime_load(tensors())
        return stats

    def _vime_load(self, weights) -> bool:
        """In place where `load_in_place` applies, else vLLM's `reload_weights`; True when in place. An engine
        that drafts with MTP layers (`--vllm-speculative-config`) loads the update's MTP tensors into its drafter
        in the same call (`draft_loading`)."""
        from vime.engine.in_vllm import draft_loading
        from vime.engine.in_vllm.weight_loading import load_in_place, packing_cpu_experts

        runner = self.model_runner
        draft = draft_loading.draft_model(runner)
        if draft is not None:
            text_config = self.vllm_config.model_config.hf_config.get_text_config()
            weights = split = draft_loading.DraftSplit(weights, text_config.num_hidden_layers)
        in_place = load_in_place(self.vllm_config, runner.get_model(), weights)
        if not in_place:
            with packing_cpu_experts(runner.get_model()):
                self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:
            for reset in ("reset_encoder_cache", "reset_mm_cache"):  # what reload_weights resets after loading
                if hasattr(runner, reset):
                    getattr(runner, reset)()
        if draft is not None:
            split.drain()
            draft_loading.load(self.vllm_config, runner.get_model(), draft, split.draft)
        return in_place

    def vime_load_ipc_weights(self, path: str) -> dict:
        """Colocated GPUs: reload from the trainer's CUDA IPC handles in `path` (see weight_transport.cuda_ipc)."""
        from vime.engine.in_vllm.cuda_ipc import open_ipc_tensors

        count = 0
        opened = open_ipc_tensors(path, self.device.index)  # checks the path and every handle file first

        def tensors():
            nonlocal count
            for name, tensor in opened:
                count += 1
                yield name, tensor

        in_place = self._vime_load(tensors())
        return {"tensors": count, "in_place": in_place}
