"""`packed_rope_thd` rotates packed sequences exactly as Megatron's `_apply_rotary_pos_emb_thd` does (both
frequency tables, interleaved or not, multi-latent scaling), without reading the packed boundaries on the host:
on `meta` tensors (where a host read fails) it runs, Megatron's does not."""

from __future__ import annotations

import pytest
import torch

from vime.trainer.megatron.packed_rope import _MEGATRON_THD, packed_rope_thd, token_positions


class _OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("exact_table", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("lengths", [[5, 1, 9], [12], [3, 3, 3, 3]])
def test_same_rotation_as_megatron(exact_table, interleaved, lengths):
    g = torch.Generator().manual_seed(sum(lengths))
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(total, 4, 16, generator=g)
    rows = total if exact_table else max(lengths) + 3
    freqs = torch.randn(rows, 1, 1, 16, generator=g)
    ours = packed_rope_thd(t, cu, freqs, interleaved, False, 1.0, _OneRank())
    theirs = _MEGATRON_THD(t, cu, freqs, interleaved, False, 1.0, _OneRank())
    assert torch.equal(ours, theirs)


def test_positions_within_each_sequence():
    cu = torch.tensor([0, 2, 3, 7])
    assert token_positions(cu, 7).tolist() == [0, 1, 0, 0, 1, 2, 3]


def test_no_host_read():
    t, freqs = torch.empty(9, 4, 16, device="meta"), torch.empty(20, 1, 1, 16, device="meta")
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    assert packed_rope_thd(t, cu, freqs, False, False, 1.0, _OneRank()).shape == (9, 4, 16)
    with pytest.raises((RuntimeError, NotImplementedError)):  # .tolist() of a device tensor
        _MEGATRON_THD(t, cu, freqs, False, False, 1.0, _OneRank())
