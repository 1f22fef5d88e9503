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


def test_fifty_cycles_bit_exact_with_no_growth_of_host_memory():
    import psutil

    torch.manual_seed(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))  # ~8 MB of parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    off = TorchStateOffloader(model, opt)
    proc = psutil.Process()
    rss = []
    for cycle in range(50):
        before = state_checksum(model, opt)
        off.offload()
        off.restore()
        assert state_checksum(model, opt) == before, f"cycle {cycle}"
        if cycle == 0:
            first_allocations = off.allocations
        if cycle in (5, 49):
            rss.append(proc.memory_info().rss)
    assert off.allocations == first_allocations, "host buffers are allocated in the first cycle only"
    growth = (rss[1] - rss[0]) / rss[0]
    assert growth < 0.05, f"host memory grew {growth:.1%} between cycle 5 and 50"


def test_offload_returns_the_caching_allocators_memory_to_the_driver(monkeypatch):
    """On a GPU, freed storage stays reserved by PyTorch's caching allocator unless emptied; the sampler's wake in
    another process would then run out of memory. Checked here by the calls made (benchmarks/gpu checks the bytes)."""
    model, opt = _trained_model()
    off = TorchStateOffloader(model, opt)
    calls = []

    def empty_cache():
        calls.append(("empty_cache", model[0].weight.numel()))  # the state's storage must be freed already

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(("synchronize", None)))
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    stats = off.offload()
    assert calls == [("synchronize", None), ("empty_cache", 0)], calls
    assert stats.device_reserved_bytes == 0
    calls.clear()
    off.restore()
    assert calls == [], "restore allocates; it has nothing to release"


def test_offload_without_cuda_initialised_releases_nothing(monkeypatch):
    model, opt = _trained_model()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("empty_cache without a CUDA context"))
    assert not torch.cuda.is_initialized()
    assert TorchStateOffloader(model, opt).offload().device_reserved_bytes is None
