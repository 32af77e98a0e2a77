"""Steps that must not reach the weights: a step whose loss or gradients are NaN or inf on any rank is skipped
(`FiniteStepGuard`), and a step that leaves a parameter non-finite stops the run (`check_finite_parameters`).
Both answer the same on every rank (one all-reduce), or the next collective would hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class FiniteStepGuard:
    """The optimizer as `train_step` sees it for one step: `step()` is skipped, as Megatron skips an fp16 overflow
    (returns (False, None, None)), when a loss (`watch`) or a gradient on any rank is NaN or inf. bf16 and fp32
    have no loss scaler to catch them, and one such step writes NaN into every weight. With a loss scaler (fp16)
    Megatron's own check runs instead: it must see the overflow to lower the scale."""

    def __init__(self, optimizer, model):
        self.optimizer, self.model = optimizer, model
        self.non_finite_loss: torch.Tensor | bool = False  # a flag on the loss's device, read once in `step`
        self.reason: str | None = None  # why the step was skipped

    def __getattr__(self, name):  # zero_grad, param_groups, ...: the optimizer's own
        return getattr(self.optimizer, name)

    def watch(self, loss_fn):
        def watched(indices, inputs, output, *mtp):
            loss, metrics = loss_fn(indices, inputs, output, *mtp)
            self.non_finite_loss = ~torch.isfinite(loss.detach()).all() | self.non_finite_loss  # no host sync
            return loss, metrics

        return watched

    def step(self):
        if not _has_loss_scaler(self.optimizer):
            self.reason = non_finite_step_reason(self.model, self.non_finite_loss)
            if self.reason is not None:
                return False, None, None
        return self.optimizer.step()


def _has_loss_scaler(optimizer) -> bool:
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(getattr(o, "grad_scaler", None) is not None for o in optimizers)


def _any_rank(flags: list, device) -> list[bool]:
    """Each flag (a bool, or a 0-dim tensor on `device`) OR-ed over every rank (all ranks must agree to skip or
    stop, or the next collective hangs); read with one host sync."""
    return [bool(x) for x in _on_any_rank(flags, device).tolist()]


def _on_any_rank(flags: list, device) -> torch.Tensor:
    """`_any_rank`'s flags as a float tensor on `device`, not read: 1.0 where some rank raised the flag."""
    t = torch.stack([_flag(f, device) for f in flags])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def _flag(flag, device) -> torch.Tensor:
    """A 0-dim float flag on `device`: a tensor as it is, a bool filled in there (a copy from the host would make
    the host wait)."""
    if isinstance(flag, torch.Tensor):
        return flag.to(device, non_blocking=True).reshape(()).float()
    return torch.full((), float(flag), device=device)


def _device(model) -> torch.device:
    return next(p for m in model for p in m.parameters()).device


def non_finite_step_reason(model, non_finite_loss) -> str | None:
    """Why this step's gradients must not be applied ("non_finite_loss", "non_finite_grad_norm"), or None; the
    same answer on every rank. Reads the gradients Megatron's DDP accumulated (`main_grad`). Collective."""
    grads = [p.main_grad for m in model for p in m.parameters() if getattr(p, "main_grad", None) is not None]
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else True
    loss_bad, grad_bad = _any_rank([non_finite_loss, ~finite if grads else False], _device(model))
    return "non_finite_loss" if loss_bad else "non_finite_grad_norm" if grad_bad else None


def check_finite_parameters(model, step: int) -> None:
    """Raise if a parameter holds NaN or inf after optimizer step `step`: stop before such weights are sent to the
    engines or saved. Collective (every rank raises together)."""
    named = [(name, p) for m in model for name, p in m.named_parameters()]
    non_finite = torch.stack([~torch.isfinite(p).all() for _, p in named]).float()
    # this rank's parameters, then whether any rank holds one: one device sync, not one a tensor
    *here, anywhere = torch.cat([non_finite, _on_any_rank([non_finite.amax()], _device(model))]).tolist()
    if anywhere:
        bad = next((name for (name, _), flag in zip(named, here) if flag), None)
        where = f"parameter {bad}" if bad else "a parameter on another rank"
        raise RuntimeError(f"optimizer step {step} left {where} non-finite (NaN or inf) although its loss and "
                           "gradients were finite; the run stops before these weights reach the engines or a "
                           "checkpoint. Lower --lr or raise --adam-eps, or resume from the last checkpoint")
