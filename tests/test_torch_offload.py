"""Trainer state offload/restore with real PyTorch: bit-exact, buffers reused."""

from __future__ import annotations

import pytest
import torch

from llmd_timeslice.snapshot.torch_offload import StateChecksumMismatch, TorchStateOffloader, state_checksum


def _trained_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(16, 32)).pow(2).mean().backward()
    opt.step()
    return model, opt


def test_trainer_state_round_trips_bit_exact_and_buffers_are_reused():
    model, opt = _trained_model()
    off = TorchStateOffloader(model, opt)
    for cycle in range(10):
        before = state_checksum(model, opt)
        stats = off.offload()
        assert model[0].weight.numel() == 0, "offload must free the working storage"
        off.restore()
        assert state_checksum(model, opt) == before, f"cycle {cycle}: restored state differs"
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        if cycle == 0:
            first_allocations = off.allocations
    assert off.allocations == first_allocations, "host buffers must be allocated once and reused"
    assert stats.bytes > 0


def test_corrupted_host_copy_is_refused_and_state_stays_offloaded():
    model, opt = _trained_model()
    off = TorchStateOffloader(model, opt)
    off.offload()
    next(iter(off._host.values()))[0].view(-1)[0] += 1  # corrupt the host copy
    with pytest.raises(StateChecksumMismatch, match="last checkpoint"):
        off.restore()
    assert off.offloaded
