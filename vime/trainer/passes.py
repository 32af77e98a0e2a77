"""The two passes the trainer runs over a rollout's micro-batches: forward-only (log-probs, the critic's values)
and a training step.

Both run Megatron's own schedule (`get_forward_backward_func`), so pipeline parallel works unchanged. Loss and
log-probs exist on the last pipeline stage only. The model is hooked for the pass only: the output layer sees just
the response tokens' rows, the rotary embedding each packed token's own position, each token its own LoRA adapter.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from vime.config.rollout import RolloutConfig
from vime.config.train import MegatronConfig, RoutingReplayConfig, TrainLoopConfig
from vime.trainer.batching import MicroBatchInputs, micro_batch_inputs
from vime.trainer.log_probs import response_log_probs
from vime.trainer.megatron.attention import SDPAttention, SharedPromptSeqParams, cached_prompt_sharing_plan
from vime.trainer.megatron.device import training_device
from vime.trainer.megatron.lora import routed
from vime.trainer.megatron.multi_token_prediction import mtp_layers, mtp_trains
from vime.trainer.mtp_loss import mtp_cross_entropy
from vime.trainer.train_batch import TrainBatch
from vime.utils.lora_adapters import adapter_names


def _output_layer(chunk):
    """The last stage's output layer (LM head, or the critic's value head) of a (DDP-wrapped) chunk, else None."""
    module = getattr(chunk, "module", chunk)
    return getattr(module, "output_layer", None) if getattr(module, "post_process", False) else None


@contextlib.contextmanager
def only_rows(chunk, rows: torch.Tensor):
    """Within the block, `chunk`'s output layer sees only `rows` of the flattened [seq x batch] hidden states,
    as a [len(rows), 1, hidden] sequence: the model returns [1, len(rows), vocab] logits for just the positions
    whose log-probs are needed (response tokens), not for every prompt and padding position."""
    layer = _output_layer(chunk)
    if layer is None:
        yield
        return
    sequence_parallel = getattr(layer, "sequence_parallel", False)

    def select(hidden: torch.Tensor) -> torch.Tensor:
        return hidden.reshape(-1, 1, hidden.shape[-1]).index_select(0, rows.to(hidden.device, non_blocking=True))

    if sequence_parallel:  # the layer gathers the sequence itself: pick the rows from its full output
        handle = layer.register_forward_hook(lambda mod, args, output: (select(output[0]), *output[1:]))
    else:
        handle = layer.register_forward_pre_hook(lambda mod, args: (select(args[0]), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def packed_seq_params(inputs: MicroBatchInputs) -> PackedSeqParams | None:
    if inputs.cu_seqlens is None:
        return None
    device = training_device()
    cu = inputs.cu_seqlens.to(device, non_blocking=True)
    fields = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=inputs.max_seqlen,
                  max_seqlen_kv=inputs.max_seqlen)
    if inputs.segment_prefix is None:
        return PackedSeqParams(**fields)
    plan = cached_prompt_sharing_plan(tuple(inputs.cu_seqlens.tolist()), tuple(inputs.segment_prefix))
    return SharedPromptSeqParams(**fields, plan=plan.to(device))


def _gpt_model(chunk):
    """The GPTModel inside a (DDP- or otherwise wrapped) model chunk."""
    while not hasattr(chunk, "position_embedding_type") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def prompt_sharing(args, model) -> str | None:
    """Why micro-batches cannot share prompts (`batching.shared_prompt_inputs`) in this model, or None when they
    can: --share-group-prompts, packed (thd) sequences, one adapter for all samples (--lora-adapters routes each
    token by its own sample), vime's SDPA attention (TransformerEngine's takes no prompt mask), Megatron's
    RotaryEmbedding (`per_token_rope` gives each token its own position), no context parallel (it splits
    sequences), no linear-attention layers (a recurrent state, not keys, carries the prompt), and a dense model
    (an MoE's load-balancing loss counts every copy of a prompt token; routing replay is per token of each sample's
    own sequence)."""
    train_loop = TrainLoopConfig.of(args)
    routing_replay = RoutingReplayConfig.of(args)
    if not train_loop.share_group_prompts:
        return "--no-share-group-prompts"
    if not is_packed(args):
        return "--qkv-format bshd"
    if adapter_names(args):
        return "--lora-adapters"
    if routing_replay.use_rollout_routing_replay:
        return "--use-rollout-routing-replay"
    gpt = _gpt_model(model[0])
    config = gpt.config
    if not any(isinstance(m, SDPAttention) for m in gpt.modules()):
        return "the attention is not vime's SDPAttention (TransformerEngine's or Megatron's own)"
    if config.multi_latent_attention:  # its RoPE is applied inside the attention, from packed positions
        return "multi-latent attention"
    if config.linear_attention_freq:  # each response would need the state its prompt left in every such layer
        return "linear-attention (Gated DeltaNet) layers"
    if mtp_layers(gpt):  # each layer reads the token after each position in its own sequence
        return "multi-token-prediction layers (--mtp-num-layers)"
    rope = getattr(gpt, "rotary_pos_emb", None)
    if gpt.position_embedding_type != "rope" or type(rope) is not RotaryEmbedding:
        return f"{gpt.position_embedding_type} positions ({type(rope).__name__})"
    if config.context_parallel_size > 1:
        return "context parallel"
    if config.num_moe_experts:
        return "an MoE model"
    return None


@contextlib.contextmanager
def per_token_rope(chunk, positions: torch.Tensor):
    """Within the block, `chunk`'s rotary embedding gives one row per packed token, at that token's position, in
    place of one per position from 0, so that a response continuing a shared prompt is rotated from where the
    prompt ends. (Megatron's packed RoPE reads a table with as many rows as the packed row as one row per
    token.)"""
    gpt = _gpt_model(chunk)
    rows = positions.reshape(-1)
    handle = gpt.rotary_pos_emb.register_forward_hook(
        lambda mod, args, emb: emb.index_select(0, rows.to(emb.device, non_blocking=True)))
    try:
        yield
    finally:
        handle.remove()


def adapter_route(inputs: MicroBatchInputs, adapters: list[int]) -> torch.Tensor:
    """Each token's adapter index (multi-LoRA) in the layout of the model's hidden states: [T, 1] packed (the
    padding sequence, if any, takes adapter 0: it is never read), [longest, b] padded."""
    if inputs.cu_seqlens is not None:
        lengths = (inputs.cu_seqlens[1:] - inputs.cu_seqlens[:-1]).long()
        ids = torch.tensor(adapters + [0] * (len(lengths) - len(adapters)), dtype=torch.long)
        route = torch.repeat_interleave(ids, lengths).unsqueeze(1)
    else:
        route = torch.tensor(adapters, dtype=torch.long).unsqueeze(0).expand(inputs.tokens.shape[1], -1)
    return route.to(training_device(), non_blocking=True)


def run_schedule(model, micro_batches: list[list[int]], batch: TrainBatch, loss_fn: Callable,
                 forward_only: bool, packed: bool = True, routing=None, share_prompts: bool = False):
    """Run Megatron's schedule over micro-batches of sample indices.

    loss_fn(indices, inputs, output) -> (loss tensor, metrics dict) on the last stage, where `output` holds one
    row per response token ([R, vocab / TP] logits, or [R, 1] critic values) and `inputs` is the micro-batch's
    `MicroBatchInputs`. `packed`: sequences packed without padding (thd) or right-padded (bshd). `routing`: a
    `routing_replay.RoutingReplay` that replays or records the MoE routing of each micro-batch. Returns the
    list of metrics dicts (last stage) or [] (other stages). Micro-batches differ in length
    (variable_seq_lengths). `share_prompts`: samples of a micro-batch that share a prompt hold one copy of it
    (`prompt_sharing` says where the model allows it)."""
    if share_prompts and (not packed or batch.adapters is not None or routing is not None):
        raise ValueError("shared prompts need packed sequences, one adapter for all samples and no routing replay "
                         "(see passes.prompt_sharing)")
    # sequence parallel splits the sequence dimension over the TP ranks: it must divide evenly
    multiple = parallel_state.get_tensor_model_parallel_world_size() if model[0].config.sequence_parallel else 1
    inputs = [micro_batch_inputs([batch.tokens[i] for i in mb], [batch.response_lengths[i] for i in mb],
                                 packed=packed, multiple=multiple, share_prompts=share_prompts)
              for mb in micro_batches]
    routes = [adapter_route(x, [batch.adapters[i] for i in mb]) if batch.adapters is not None else None
              for mb, x in zip(micro_batches, inputs)]
    longest = max(int(x.tokens.numel()) if packed else x.tokens.shape[1] for x in inputs)

    def data_iter():
        yield from zip(micro_batches, inputs, routes)

    def forward_step(iterator, chunk):
        indices, mb, route = next(iterator)
        device = training_device()
        tokens, positions = mb.tokens.to(device, non_blocking=True), mb.positions.to(device, non_blocking=True)
        replay = routing.micro_batch(indices, [len(batch.tokens[i]) for i in indices], packed) if routing is not None \
            else contextlib.nullcontext()
        rope = per_token_rope(chunk, mb.positions) if mb.segment_prefix is not None else contextlib.nullcontext()
        gpt = _gpt_model(chunk)
        mtp = mtp_cross_entropy(gpt, mb, tokens, positions) if not forward_only and mtp_trains(gpt) \
            else contextlib.nullcontext()
        with only_rows(chunk, mb.logit_rows), replay, routed(chunk, route), rope, mtp as mtp_ce:
            output = chunk(tokens, positions, attention_mask=None, packed_seq_params=packed_seq_params(mb))

        def loss_func(output):  # `output.squeeze(0)`: a view, its backward allocates nothing
            if mtp_ce is None:
                return loss_fn(indices, mb, output.squeeze(0))
            return loss_fn(indices, mb, output.squeeze(0), mtp_ce)  # the MTP layers' cross-entropy too

        return output, loss_func

    for m in model:
        m.train(not forward_only)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iter(), model=model,
        num_microbatches=len(micro_batches), seq_length=longest, micro_batch_size=1, forward_only=forward_only)


class OnHost:
    """Per-sample tensors a forward-only pass computes on the device, copied to the host in one transfer when the
    pass ends (a copy per sample would wait for the device once per sample)."""

    def __init__(self):
        self.parts: list[tuple[list[int], list[int], torch.Tensor]] = []  # (indices, lengths, [sum lengths])

    def add(self, indices: list[int], tensors: list[torch.Tensor]) -> None:
        self.parts.append((list(indices), [t.numel() for t in tensors], torch.cat([t.detach().float().reshape(-1)
                                                                                      for t in tensors])))

    def gather(self) -> dict[int, torch.Tensor]:
        if not self.parts:
            return {}
        flat = torch.cat([p[2] for p in self.parts]).cpu()
        out, start = {}, 0
        for indices, lengths, _ in self.parts:
            for i, piece in zip(indices, flat[start:start + sum(lengths)].split(lengths)):
                out[i] = piece
            start += sum(lengths)
        return out


def forward_values(args, model, batch: TrainBatch, micro_batches: list[list[int]]) -> dict[int, torch.Tensor]:
    """Critic: {sample index: values of its response tokens} on the last stage, {} elsewhere."""
    values_on_host = OnHost()

    def loss_fn(indices, inputs, values):
        values_on_host.add(indices, list(values[:, 0].float().split(inputs.response_lengths)))
        return torch.zeros((), device=values.device), {}

    with torch.no_grad():
        run_schedule(model, micro_batches, batch, loss_fn, forward_only=True, packed=is_packed(args),
                     share_prompts=prompt_sharing(args, model) is None)
    return values_on_host.gather()


def forward_log_probs(args, model, batch: TrainBatch, micro_batches: list[list[int]], with_entropy: bool = False,
                      routing=None, temperature: float | None = None):
    """{sample index: (log-probs of its response tokens, entropy or None)} on the last stage, {} elsewhere; at
    `temperature` (default: --rollout-temperature, the engines' sampling temperature)."""
    if temperature is None:
        temperature = RolloutConfig.of(args).rollout_temperature
    log_probs_on_host, entropy_on_host = OnHost(), OnHost()

    def loss_fn(indices, inputs, logits):
        lps, ents = response_log_probs(logits, inputs.targets, inputs.response_lengths, temperature, with_entropy)
        log_probs_on_host.add(indices, lps)
        if ents is not None:
            entropy_on_host.add(indices, ents)
        return torch.zeros((), device=logits.device), {}

    with torch.no_grad():
        run_schedule(model, micro_batches, batch, loss_fn, forward_only=True, packed=is_packed(args), routing=routing,
                     share_prompts=prompt_sharing(args, model) is None)
    log_probs, entropy = log_probs_on_host.gather(), entropy_on_host.gather()
    return {i: (lp, entropy.get(i)) for i, lp in log_probs.items()}


def is_packed(args) -> bool:
    """--qkv-format thd (default): micro-batches packed without padding; bshd: right-padded."""
    megatron = MegatronConfig.of(args)
    return megatron.qkv_format == "thd"


def train_step(args, model, optimizer, scheduler, batch: TrainBatch, micro_batches: list[list[int]], loss_fn,
               routing=None):
    """One optimizer step over this rank's micro-batches. Returns (metrics list, grad_norm, lr, skipped)."""
    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = run_schedule(model, micro_batches, batch, loss_fn, forward_only=False, packed=is_packed(args),
                           routing=routing, share_prompts=prompt_sharing(args, model) is None)
    update_successful, grad_norm, _ = optimizer.step()
    lr = optimizer.param_groups[0]["lr"]
    if update_successful:
        scheduler.step(increment=1)
    return metrics, grad_norm, lr, not update_successful


def is_last_stage() -> bool:
    return parallel_state.is_pipeline_last_stage()
