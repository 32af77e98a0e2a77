"""FLOPs of a rollout's training, counted from what the trainer runs rather than estimated from the token count.

    shape = FlopShape.from_hf(hf_config, lora_rank=0)
    work = [micro_batch_work(inputs, lengths) for inputs, lengths in step]   # batching.micro_batch_inputs
    flops = pass_flops(shape, work, train=True)     # {"matmul", "attention", "logits", "total", "useful"}

What is counted is what the kernels compute, as `torch.utils.flop_counter` counts them (2 FLOPs a multiply-add):
- the linear layers over every row the layers see: real tokens when packed, padding too when padded, a shared
  prompt once per micro-batch (`batching.shared_prompt_inputs`);
- the output layer over the response rows only (the trainer asks for no other logits);
- each attention call as the kernel is given it: the padded [batch, heads, q, k] calls of `SDPAttention` (causal or
  masked: the whole rectangle), or one [s, s] call per sequence where the varlen kernel runs (CUDA, 16-bit);
- MoE: the router for every token, `experts_per_token` routed experts (dropless), the shared experts;
- training: a linear layer's backward is twice its forward (input and weight gradients; a frozen LoRA base only
  the input gradient), attention's 2.5 times (the scores recomputed, then dQ, dK, dV and dP).
`useful` is the part an MFU counts as work: causal attention's lower triangle and no padding rows.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BACKWARD = 2.5  # backward / forward of scaled-dot-product attention, as torch's flop counter has it


@dataclass(frozen=True)
class FlopShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: float
    ffn: int  # the dense MLP's intermediate size
    vocab: int
    moe_layers: int = 0  # how many of the layers are MoE
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn: int = 0
    shared_expert_ffn: int = 0
    lora_rank: int = 0  # adapters on every linear layer of attention and MLP; the base frozen
    # multi-latent attention (DeepSeek-V3): head_dim is then the mean of the query-key and value widths
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # Gated DeltaNet (Qwen3-Next, Qwen3.5): how many layers, their key / value heads and sizes, the convolution's
    # kernel; and the full-attention layers' output gate (q_proj twice as wide)
    linear_layers: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    output_gate: bool = False

    @classmethod
    def from_hf(cls, config, lora_rank: int = 0) -> FlopShape:
        """The shape of an HF config; its MoE layout as the model is built from it (`hf_architecture.hf_moe`)."""
        from vime.trainer.megatron.hf_architecture import hf_linear_attention, hf_moe, language_config

        config = language_config(config)
        heads = config.num_attention_heads
        moe, linear = hf_moe(config), hf_linear_attention(config)
        hybrid = {"linear_layers": sum(linear["linear_attention_freq"]), "output_gate": True,
                  "linear_key_heads": linear["linear_num_key_heads"], "linear_key_dim": linear["linear_key_head_dim"],
                  "linear_value_heads": linear["linear_num_value_heads"],
                  "linear_value_dim": linear["linear_value_head_dim"],
                  "linear_conv_kernel": linear["linear_conv_kernel_dim"]} if linear["linear_attention_freq"] else {}
        mla = {"q_lora_rank": getattr(config, "q_lora_rank", None) or 0, "kv_lora_rank": config.kv_lora_rank,
               "qk_nope_dim": config.qk_nope_head_dim, "qk_rope_dim": config.qk_rope_head_dim,
               "v_head_dim": config.v_head_dim} if getattr(config, "kv_lora_rank", None) else {}
        head_dim = (mla["qk_nope_dim"] + mla["qk_rope_dim"] + mla["v_head_dim"]) / 2 if mla else \
            getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim, **mla,
                   ffn=getattr(config, "intermediate_size", None) or config.moe_intermediate_size,
                   vocab=config.vocab_size,
                   moe_layers=sum(moe["moe_layer_freq"] or []), num_experts=moe["num_experts"] or 0,
                   experts_per_token=moe["moe_router_topk"] or 0, moe_ffn=moe["moe_ffn_hidden_size"] or 0, **hybrid,
                   shared_expert_ffn=moe["moe_shared_expert_intermediate_size"] or 0, lora_rank=lora_rank)

    def _linears(self, moe: bool) -> list[tuple[int, int, float]]:
        """(in, out, times per token) of a (full-attention) layer's linear maps."""
        return self._attention_linears(linear=False) + self._mlp_linears(moe)

    def _attention_linears(self, linear: bool) -> list[tuple[int, int, float]]:
        """The token mixer's linear maps: a Gated DeltaNet layer's (`linear`: in_proj's q, k, v, z, b, a, then
        out_proj), multi-latent attention's, or q/k/v (q twice as wide with an output gate) and the output."""
        if linear:
            keys, values = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
            return [(self.hidden, 2 * keys + 2 * values + 2 * self.linear_value_heads, 1.0), (values, self.hidden, 1.0)]
        if self.kv_lora_rank:
            qk = self.heads * (self.qk_nope_dim + self.qk_rope_dim)
            queries = [(self.hidden, self.q_lora_rank, 1.0), (self.q_lora_rank, qk, 1.0)] if self.q_lora_rank \
                else [(self.hidden, qk, 1.0)]
            return queries + [(self.hidden, self.kv_lora_rank + self.qk_rope_dim, 1.0),
                              (self.kv_lora_rank, self.heads * (self.qk_nope_dim + self.v_head_dim), 1.0),
                              (self.heads * self.v_head_dim, self.hidden, 1.0)]
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(self.hidden, q * (2 if self.output_gate else 1) + 2 * kv, 1.0), (q, self.hidden, 1.0)]

    def _mlp_linears(self, moe: bool) -> list[tuple[int, int, float]]:
        if not moe:
            return [(self.hidden, 2 * self.ffn, 1.0), (self.ffn, self.hidden, 1.0)]
        routed = [(self.hidden, 2 * self.moe_ffn, self.experts_per_token),
                  (self.moe_ffn, self.hidden, self.experts_per_token)]
        shared = [(self.hidden, 2 * self.shared_expert_ffn, 1.0), (self.shared_expert_ffn, self.hidden, 1.0)] \
            if self.shared_expert_ffn else []
        gate = [(self.hidden, 1, 1.0)] if self.shared_expert_ffn and self.output_gate else []  # Qwen3-Next's
        return [(self.hidden, self.num_experts, 1.0)] + routed + shared + gate

    def layer_flops_per_token(self) -> tuple[float, float]:
        """Forward FLOPs of one token through every layer's linear maps: (the base weights, the LoRA adapters)."""
        base = adapters = 0.0
        parts = [(self.moe_layers, self._mlp_linears(True)), (self.layers - self.moe_layers, self._mlp_linears(False)),
                 (self.linear_layers, self._attention_linears(True)),
                 (self.layers - self.linear_layers, self._attention_linears(False))]
        for count, linears in parts:
            for n_in, n_out, times in linears:
                base += count * times * 2 * n_in * n_out
                if self.lora_rank and n_out not in (self.num_experts, 1):  # no adapter on the router or a gate
                    adapters += count * times * 2 * self.lora_rank * (n_in + n_out)
        return base, adapters

    def linear_attention_flops(self, batch: int, longest: int, train: bool) -> float:
        """FLOPs of the Gated DeltaNet layers over `batch` rows of `longest` tokens, as
        `gated_delta_rule.chunked_gated_delta_rule` multiplies (chunks of CHUNK, the rows padded to whole chunks) and
        the depthwise convolution before it computes; `train`: with the backward, twice each product's forward
        (autograd skips a few of the state's products where a row's first and last chunks need no gradient: 2 of
        the 9 per chunk of a one-chunk row, none measurable over many chunks)."""
        if not self.linear_layers:
            return 0.0
        from vime.trainer.megatron.gated_delta_rule import CHUNK

        c, dk, dv = CHUNK, self.linear_key_dim, self.linear_value_dim
        chunks = batch * -(-longest // c)
        per_chunk = 4 * c * c * dk + 2 * c * c * dv + 6 * c * dk * dv  # K K^T, Q K^T, (Q K^T) U; the state's three
        channels = 2 * self.linear_key_heads * dk + self.linear_value_heads * dv
        conv = 2 * self.linear_conv_kernel * channels * batch * longest
        factor = 3.0 if train else 1.0
        return factor * self.linear_layers * (self.linear_value_heads * chunks * per_chunk + conv)


@dataclass(frozen=True)
class MicroBatchWork:
    rows: int  # rows the layers compute (with padding)
    real_rows: int  # of which real tokens
    logit_rows: int  # rows the output layer computes
    attention: tuple[tuple[int, int, int], ...]  # (batch, queries, keys) of each attention call
    causal: tuple[bool, ...]  # per call: causal (the useful part is the lower triangle) or masked


def micro_batch_work(inputs, lengths: list[int], varlen: bool = False) -> MicroBatchWork:
    """What the layers compute for `inputs` (a `batching.MicroBatchInputs` of samples of `lengths` tokens), as
    `attention.SDPAttention` calls its kernels: `varlen` where it takes the varlen kernel (CUDA, 16-bit)."""
    rows, real, logit_rows = inputs.tokens.numel(), sum(lengths), len(inputs.logit_rows)
    if inputs.cu_seqlens is None:  # padded: [b, longest], one causal call over the batch
        batch, longest = inputs.tokens.shape
        return MicroBatchWork(rows, real, logit_rows, ((batch, longest, longest),), (True,))
    cu = inputs.cu_seqlens.tolist()
    segments = [b - a for a, b in zip(cu, cu[1:])]
    if inputs.segment_prefix is not None:  # shared prompts: the prompts and whole samples, then the responses
        prefix = inputs.segment_prefix  # one entry per packed segment (a sequence-parallel pad segment included)
        alone = [n for n, p in zip(segments, prefix) if p < 0]
        continuing = [(n, segments[p]) for n, p in zip(segments, prefix) if p >= 0]
        calls, causal = [(len(alone), max(alone), max(alone))], [True]
        if continuing:
            calls.append((len(continuing), max(n for n, _ in continuing), max(n + m for n, m in continuing)))
            causal.append(False)
        return MicroBatchWork(rows, rows, logit_rows, tuple(calls), tuple(causal))  # a prompt counts once
    if varlen:
        return MicroBatchWork(rows, real, logit_rows, tuple((1, n, n) for n in segments), (True,) * len(segments))
    longest = max(segments)
    return MicroBatchWork(rows, real, logit_rows, ((len(segments), longest, longest),), (True,))


def pass_flops(shape: FlopShape, work: list[MicroBatchWork], train: bool) -> dict[str, float]:
    """FLOPs of one pass over micro-batches `work`: a training step's forward and backward (`train`), or a
    forward-only pass (old log-probs, the reference's, the teacher's). {"matmul", "attention", "logits", "total",
    "useful"}."""
    base, adapters = shape.layer_flops_per_token()
    matmul = attention = logits = useful = 0.0
    frozen = shape.lora_rank > 0
    linear_factor = (2.0 if frozen else 3.0) if train else 1.0  # a frozen base: no weight gradient
    attention_factor = 1.0 + ATTENTION_BACKWARD if train else 1.0
    for w in work:
        matmul += linear_factor * base * w.rows + (3.0 if train else 1.0) * adapters * w.rows
        useful += linear_factor * base * w.real_rows + (3.0 if train else 1.0) * adapters * w.real_rows
        for (batch, queries, keys), causal in zip(w.attention, w.causal):
            full = shape.layers - shape.linear_layers
            computed = 2 * 2 * batch * shape.heads * shape.head_dim * queries * keys * full
            attention += attention_factor * computed
            useful += attention_factor * computed * (0.5 if causal else 1.0)
            recurrent = shape.linear_attention_flops(batch, queries, train)
            attention += recurrent
            useful += recurrent
        head = 2 * shape.hidden * shape.vocab * w.logit_rows
        logits += (3.0 if train else 1.0) * head
        useful += (3.0 if train else 1.0) * head
    return {"matmul": matmul, "attention": attention, "logits": logits, "total": matmul + attention + logits,
            "useful": useful}


def rollout_flops(shape: FlopShape, steps: list[list[MicroBatchWork]], forward_passes: int) -> dict[str, float]:
    """FLOPs of training one rollout: `forward_passes` forward-only passes over all its micro-batches (the old
    log-probs, the reference's and the teacher's, as the trainer runs them), then each optimizer step's forward
    and backward over its own (`steps`: the micro-batches of each step)."""
    every = [w for step in steps for w in step]
    parts = [pass_flops(shape, every, train=False)] * forward_passes + [pass_flops(shape, s, train=True)
                                                                        for s in steps]
    return {key: sum(p[key] for p in parts) for key in ("matmul", "attention", "logits", "total", "useful")}


# dense 16-bit tensor-core peak of one GPU, TFLOP/s, by a piece of its name (vendors' data sheets, SXM parts)
PEAK_TFLOPS_16BIT = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                     "B200": 2250.0, "GB200": 2500.0}


def peak_tflops(device_name: str) -> float | None:
    """This GPU's dense bf16 peak, or None for one the table does not know (then no MFU is reported)."""
    return next((peak for key, peak in PEAK_TFLOPS_16BIT.items() if key in device_name), None)


def trainer_rollout_flops(trainer, groups: list[list[dict]]) -> dict[str, float]:
    """The FLOPs this rank spent on `trainer.train(..., groups)`, just run: its own micro-batches of every step and
    the forward-only passes the trainer counted (`MegatronTrainer.forward_passes`)."""
    from vime.trainer.megatron.attention import uses_varlen_kernel
    from vime.config.train import LoraConfig
    from vime.trainer.batching import micro_batch_inputs
    from vime.trainer.passes import is_packed, prompt_sharing
    from vime.trainer.train_batch import TrainBatch

    batch = TrainBatch.from_samples(groups, trainer.args)
    packed, share = is_packed(trainer.args), prompt_sharing(trainer.args, trainer.model) is None
    probe = next(p for m in trainer.model for p in m.parameters())
    varlen = packed and not share and uses_varlen_kernel(probe)
    steps = [[micro_batch_work(micro_batch_inputs([batch.tokens[i] for i in mb], [batch.response_lengths[i] for i in mb],
                                                  packed=packed, share_prompts=share),
                               [len(batch.tokens[i]) for i in mb], varlen) for mb in mbs]
             for _, _, mbs in trainer._split(batch)]
    shape = FlopShape.from_hf(trainer.hf_config, LoraConfig.of(trainer.args).lora_rank)
    return rollout_flops(shape, steps, trainer.forward_passes)


def flop_metrics(trainer, groups: list[list[dict]], seconds: float) -> dict[str, float]:
    """`perf/train_tflop` (this rank's useful FLOPs of the rollout), `perf/train_tflops_per_s` and, on a GPU the
    peak table knows, `perf/mfu` (of this rank's device)."""
    flops = trainer_rollout_flops(trainer, groups)["useful"]
    metrics = {"perf/train_tflop": flops / 1e12, "perf/train_tflops_per_s": flops / max(seconds, 1e-9) / 1e12}
    if trainer.device.type == "cuda":
        import torch

        peak = peak_tflops(torch.cuda.get_device_name(trainer.device))
        if peak:
            metrics["perf/mfu"] = flops / max(seconds, 1e-9) / (peak * 1e12)
    return metrics
