"""The gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5's linear attention) in plain torch: pure functions.

Per head, a state S (key dim x value dim) is carried along the sequence. At step t, with decay g_t <= 0 (a log),
write strength beta_t in (0, 1) and L2-normalised key k_t and query q_t:

    S' = exp(g_t) S_{t-1}
    u_t = beta_t (v_t - S'^T k_t)          # the delta: what S' recalls for k_t, corrected towards v_t
    S_t = S' + k_t u_t^T
    o_t = S_t^T q_t / sqrt(key dim)

`recurrent_gated_delta_rule` runs those steps one by one (the reference). `chunked_gated_delta_rule` computes the
same in chunks of C steps with matrix products: inside a chunk, with G_i the cumulative decay from the chunk's
start and S_0 the state entering it, the deltas solve a unit lower-triangular system

    (I + A) U = beta * V - (beta * exp(G) * K) S_0,   A_ij = beta_i exp(G_i - G_j) k_i . k_j  (j < i)

and then O = exp(G) * (Q S_0) + (M * Q K^T) U with M_ij = exp(G_i - G_j) (j <= i), and the state leaving the chunk
is exp(G_C) S_0 + (exp(G_C - G) * K)^T U. Every exponent is of a non-positive number, so nothing overflows.

Shapes: q, k [batch, seq, heads, key dim]; v [batch, seq, heads, value dim]; g, beta [batch, seq, heads]. Sequences
end at the end of the tensor: right padding after a sequence changes none of its outputs. Computed in float32 and
returned in v's dtype, with the final state [batch, heads, key dim, value dim] (float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the form the Qwen3-Next kernels use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _to_heads_first(q, k, v, g, beta):
    """[b, s, h, d] -> [b, h, s, d] float32 (g, beta: [b, h, s]); q scaled by 1/sqrt(key dim)."""
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    return q * q.shape[-1] ** -0.5, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """The rule step by step (the reference; slow for long sequences)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _to_heads_first(q, k, v, g, beta)
    b, h, s, dk = k.shape
    state = (torch.zeros(b, h, dk, v.shape[-1], device=v.device) if initial_state is None
             else initial_state.float())
    outs = []
    for t in range(s):
        state = state * g[:, :, t, None, None].exp()
        recalled = (state * k[:, :, t, :, None]).sum(-2)  # S'^T k_t
        delta = beta[:, :, t, None] * (v[:, :, t] - recalled)
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=1).to(out_dtype), state


CHUNK = 64  # steps a chunk computes with matrix products (what FlopShape counts too)


def chunked_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = CHUNK):
    """The rule in chunks of `chunk_size` steps (see the module docstring); the same result as the recurrent form."""
    out_dtype, seq = v.dtype, v.shape[1]
    q, k, v, g, beta = _to_heads_first(q, k, v, g, beta)
    pad = (-seq) % chunk_size
    if pad:  # zero steps after the end: decay exp(0) = 1 and beta 0 leave the state as it was
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    b, h, s, dk = k.shape
    n = s // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk_size).cumsum(-1), beta.reshape(b, h, n, chunk_size)
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: G_i - G_j > 0 there)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    system = beta[..., None] * kk * decay.tril(-1) + torch.eye(chunk_size, device=v.device)  # I + A
    # U = W_v - W_k S_0: both right-hand sides solved at once, for all chunks
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * g.exp()[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w_v, w_k = solved.split([v.shape[-1], dk], dim=-1)
    qk = (q @ k.transpose(-1, -2)) * decay
    leave = (g[..., -1:] - g).exp()[..., None] * k  # exp(G_C - G_j) k_j
    state = (torch.zeros(b, h, dk, v.shape[-1], device=v.device) if initial_state is None
             else initial_state.float())
    outs = []
    # one unbind per tensor, not an index per chunk: each index's backward would write a whole zero tensor
    chunks = zip(*(t.unbind(2) for t in (w_v, w_k, q, qk, leave, g.exp(), g[..., -1:].exp())))
    for w_v_c, w_k_c, q_c, qk_c, leave_c, decay_c, last_c in chunks:
        u = w_v_c - w_k_c @ state
        outs.append(decay_c[..., None] * (q_c @ state) + qk_c @ u)
        state = last_c[..., None] * state + leave_c.transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :seq]  # [b, h, seq, dv]
    return out.transpose(1, 2).to(out_dtype), state
