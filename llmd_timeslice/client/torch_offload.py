"""Trainer state offload/restore: parameters, gradients and optimizer state of a torch model.

``offload()`` computes a checksum of every tensor where it lives (on the device: torch reductions
at device bandwidth), copies it into host buffers that are allocated once and reused on every
cycle (pinned when CUDA is available: re-allocating pinned buffers per cycle is a known
multi-second cost: docs/benchmarks.md, "Figures from the field"), and frees the device storage (the tensors keep their Python
identity, so optimizers and hooks stay valid). ``restore()`` copies the bytes back into fresh
device storage and recomputes the checksum there, so the whole round trip (device -> host ->
device) is covered: a difference raises :class:`StateChecksumMismatch` and the state is left
offloaded (never half-restored).

The checksum is two wrapping 64-bit sums per tensor over its raw bytes (a plain sum and a sum
weighted by 4 KiB-chunk position), not a cryptographic hash: it detects corrupted or misplaced
chunks, bit flips and partial copies, and costs a reduction instead of hashing every byte on one
host core (BLAKE2b's rate and what it costs a 7B trainer: docs/benchmarks.md, "Results: the model"). Where the
state lives in host memory (the CPU "device" here) the checksum is fused with the copy
(:func:`copy_many_with_checksums`: 256 KiB chunks, each summed right after it is copied, while it is in
cache; the chunks of every tensor split among the threads once), so offload and restore make one pass over
memory, not two (docs/decisions/trainer-state-checksum-on-device.md); on an accelerator it stays a
device reduction next to the host <-> device copy.

Freeing a tensor's storage on a GPU only returns it to PyTorch's caching allocator, which keeps the
blocks reserved in this process: the device would look full to the driver, and the sampler's wake in
another process would fail out of memory. So ``offload()`` ends by returning the allocator's free
blocks to the driver (``torch.cuda.synchronize()`` then ``torch.cuda.empty_cache()``, whenever this
process has initialised CUDA) and reports what stays reserved (``OffloadStats.device_reserved_bytes``;
memory still referenced by other live tensors of the process stays reserved). ``benchmarks/gpu/
snapshot_gpu.py`` checks on a GPU that this is about zero.

What an offload leaves on the device is reported, not only what it moved (issue 38 §1: a residual that grows cycle
after cycle until the other side runs out of memory, NVIDIA-NeMo/RL#2619): ``device_reserved_bytes``
(``torch.cuda.memory_reserved()``: what the driver sees this process hold) and ``device_allocated_bytes``
(``torch.cuda.memory_allocated()``: live tensors, the state's or others'), both None where CUDA was never
initialised (a CPU trainer: nothing to report, not 0). Over ``device_budget_bytes`` reserved, the offload warns
(logger ``llmd_timeslice.client.torch_offload``) and sets ``OffloadStats.over_budget`` to the reason, before the
trainer yields (``on_accelerators`` offloads, then releases); ``last_offload`` keeps the figures.

On this CPU-only machine the "device" is the CPU: offload still moves the bytes into the
reusable host buffers and frees the working storage, through the same code as on a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

DEFAULT_DEVICE_BUDGET_BYTES = 1024**3
"""What an offload may leave reserved on the device before the trainer is told (module doc)."""


class StateChecksumMismatch(RuntimeError):
    """Restored bytes differ from what was offloaded; restart the job from its last checkpoint."""


class StateNotOffloaded(RuntimeError):
    """``restore()`` was called while the state is resident."""


@dataclass
class OffloadStats:
    """Figures of the last offload or restore: ``bytes`` moved, ``seconds`` taken; after an offload,
    ``device_reserved_bytes`` is the device memory PyTorch's caching allocator still reserves in this
    process (``torch.cuda.memory_reserved()``; None without CUDA), ``device_allocated_bytes`` what live tensors
    still hold (``torch.cuda.memory_allocated()``; None without CUDA), and ``over_budget`` the reason when more than
    the offloader's ``device_budget_bytes`` stays reserved (None: within it, or not measured)."""

    bytes: int
    seconds: float
    checksum: str
    allocated_buffers: int
    device_reserved_bytes: int | None = None
    device_allocated_bytes: int | None = None
    over_budget: str | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor that makes up trainer state, in a fixed order (parameters, grads, optimizer)."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    for b in model.buffers():
        out.append(b)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for v in optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.numel() > 0:
                        out.append(v)
    return out


_CHUNK_WORDS = 512  # 4 KiB of int64 words


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as the widest integer words that divide its size (no copy)."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if raw.numel() % size == 0:
            return raw.view(dtype)
    return raw


def tensor_checksum(t: torch.Tensor) -> tuple[int, int]:
    """``(sum, chunk-position-weighted sum)`` of the tensor's raw words, wrapping at 64 bits.

    Computed on the tensor's own device; only two integers cross to the host.
    """
    w = _words(t)
    n = w.numel()
    full = n - n % _CHUNK_WORDS
    tail_sum = torch.sum(w[full:], dtype=torch.int64)
    if full:  # one read pass over the bytes: the total is the sum of the chunk sums (same wrapping value)
        per_chunk = torch.sum(w[:full].view(-1, _CHUNK_WORDS), dim=1, dtype=torch.int64)
        weights = torch.arange(1, per_chunk.numel() + 1, device=w.device, dtype=torch.int64)
        weighted = torch.sum(per_chunk * weights)
        total = torch.sum(per_chunk) + tail_sum
    else:
        weighted = torch.zeros((), dtype=torch.int64, device=w.device)
        total = tail_sum
    tail = tail_sum * (full // _CHUNK_WORDS + 1)
    return int(total), int(weighted + tail)


_FUSED_CHUNK_WORDS = 1 << 15
"""Words per chunk of the fused copy + checksum (256 KiB of int64 words: copied, then summed while it is still in the
core's cache; a multiple of ``_CHUNK_WORDS``, so the sums are those of :func:`tensor_checksum`)."""

_pool: tuple[ThreadPoolExecutor, int] | None = None


def _workers() -> tuple[ThreadPoolExecutor, int]:
    """Threads of the fused copy and their number: as many as torch's intra-op threads (created once)."""
    global _pool
    if _pool is None:
        n = max(1, torch.get_num_threads())
        _pool = (ThreadPoolExecutor(n, thread_name_prefix="offload-copy"), n)
    return _pool


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child (e.g. a data-loader worker) has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool)


def copy_with_checksum(dst: torch.Tensor, src: torch.Tensor, sum_dst: bool = False) -> tuple[int, int]:
    """Copy ``src`` into ``dst`` (same number of bytes, both contiguous, on the CPU) and return the checksum
    :func:`tensor_checksum` returns for ``src`` (``sum_dst=False``: the bytes as read) or for ``dst`` (``sum_dst=True``:
    the bytes as written, so a restore checks what it will use), in one pass over memory: :func:`copy_many_with_checksums`
    of one pair."""
    return copy_many_with_checksums([(dst, src)], sum_dst)[0]


@dataclass
class _FusedCopy:
    """One tensor of a fused copy: its pair's index, its words as numpy arrays, the per-4 KiB-chunk sums being filled
    and the end of its whole chunks (``full`` words; the tail after it is copied and summed at the end)."""

    pair: int
    """Index of its pair in the call."""
    dst: np.ndarray
    src: np.ndarray
    summed: np.ndarray
    per_chunk: np.ndarray
    full: int


def _fused_part(jobs: list[_FusedCopy], plan: list[tuple[int, int, int]]) -> None:
    """Copy and sum the ``(job, lo, hi)`` word ranges of ``plan``, ``_FUSED_CHUNK_WORDS`` at a time: each chunk is
    summed right after it is copied, while it is in the core's cache (numpy releases the GIL in both loops)."""
    step = _FUSED_CHUNK_WORDS
    for ji, lo, hi in plan:
        job = jobs[ji]
        d, s, m, out = job.dst, job.src, job.summed, job.per_chunk
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            np.copyto(d[a:b], s[a:b])
            sums = out[a // _CHUNK_WORDS : b // _CHUNK_WORDS]
            np.add.reduce(m[a:b].reshape(-1, _CHUNK_WORDS), axis=1, dtype=np.int64, out=sums)


def copy_many_with_checksums(pairs: list[tuple[torch.Tensor, torch.Tensor]], sum_dst: bool = False) -> list[tuple[int, int]]:
    """Copy each ``(dst, src)`` pair (same number of bytes, both contiguous, on the CPU) and return, per pair, the
    checksum :func:`tensor_checksum` returns for ``src`` (``sum_dst=False``) or for ``dst`` (``sum_dst=True``), summing
    each 256 KiB chunk right after it is copied, while it is in cache: one pass over memory instead of two.

    The chunks of *all* the pairs are split into one contiguous share per thread (``torch.get_num_threads()``
    threads, the caller's among them) and joined once: one join per tensor left threads idle at every tensor's end (a
    trainer's state is many tensors). With torch's own ops, every chunk was a parallel region of its own, and on a
    machine whose cores are busy each of those waits for its slowest thread to be scheduled (both measured:
    docs/decisions/trainer-state-checksum-on-device.md, docs/benchmarks.md#code-figures)."""
    out: dict[int, tuple[int, int]] = {}
    jobs: list[_FusedCopy] = []
    for i, (dst, src) in enumerate(pairs):
        sw, dw = _words(src), _words(dst)
        n = sw.numel()
        if n <= _FUSED_CHUNK_WORDS or sw.dtype != dw.dtype:
            dw.copy_(sw)
            out[i] = tensor_checksum(dst if sum_dst else src)
            continue
        s_np, d_np = sw.numpy(), dw.numpy()
        full = n - n % _CHUNK_WORDS
        jobs.append(_FusedCopy(i, d_np, s_np, d_np if sum_dst else s_np, np.empty(full // _CHUNK_WORDS, dtype=np.int64), full))
    if jobs:
        pool, workers = _workers()
        plans = _split_plan([j.full for j in jobs], workers)
        futures = [pool.submit(_fused_part, jobs, plan) for plan in plans[1:]]
        try:
            _fused_part(jobs, plans[0])
        finally:
            for f in futures:
                f.result()
    for job in jobs:
        np.copyto(job.dst[job.full :], job.src[job.full :])
        with np.errstate(over="ignore"):  # wrapping 64-bit sums, as torch's
            tail_sum = np.add.reduce(job.summed[job.full :], dtype=np.int64)
            weights = np.arange(1, job.per_chunk.size + 1, dtype=np.int64)
            total = np.add.reduce(job.per_chunk) + tail_sum
            weighted = np.add.reduce(job.per_chunk * weights) + tail_sum * np.int64(job.full // _CHUNK_WORDS + 1)
        out[job.pair] = (_signed(int(total)), _signed(int(weighted)))
    return [out[i] for i in range(len(pairs))]


def _split_plan(sizes: list[int], workers: int) -> list[list[tuple[int, int, int]]]:
    """``(job, lo, hi)`` word ranges of jobs of ``sizes`` words, in ``workers`` contiguous shares of about equal size;
    every range boundary inside a job falls on a ``_FUSED_CHUNK_WORDS`` boundary (a multiple of ``_CHUNK_WORDS``). Empty
    shares are dropped; at least one share."""
    share = max(1, -(-sum(sizes) // workers))
    plans: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for ji, full in enumerate(sizes):
        lo = 0
        while lo < full:
            if room <= 0:
                plans.append([])
                room = share
            hi = min(full, -(-(lo + room) // _FUSED_CHUNK_WORDS) * _FUSED_CHUNK_WORDS)
            plans[-1].append((ji, lo, hi))
            room -= hi - lo
            lo = hi
    return plans


def _signed(v: int) -> int:
    v &= 2**64 - 1
    return v - 2**64 if v >= 2**63 else v


def _combine(sums: list[tuple[int, int]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for i, (a, b) in enumerate(sums):
        h.update(i.to_bytes(8, "little") + (a & (2**64 - 1)).to_bytes(8, "little") + (b & (2**64 - 1)).to_bytes(8, "little"))
    return h.hexdigest()


def release_cached_device_memory() -> int | None:
    """Return the CUDA caching allocator's free blocks to the driver (``torch.cuda.synchronize()``, then
    ``torch.cuda.empty_cache()``) when this process has initialised CUDA; returns the bytes still reserved
    (``torch.cuda.memory_reserved()``), or None when CUDA was never initialised (nothing is cached)."""
    if not torch.cuda.is_initialized():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved())


def state_checksum(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Checksum of every state tensor's raw bytes (see :func:`tensor_checksum`), as hex."""
    return _combine([tensor_checksum(t) for t in _tensors(model, optimizer)])


class TorchStateOffloader:
    """Offload/restore the state of ``model`` (+ ``optimizer``) with reusable host buffers.

    Args:
        model: the trainer's module.
        optimizer: its optimizer (state created lazily by the first ``step()`` is picked up on
            each offload).
        pin_memory: pin host buffers (default: when CUDA is available).
        release_device_cache: end each offload by returning the caching allocator's memory to the driver
            (:func:`release_cached_device_memory`); False only to measure what it saves.
        device_budget_bytes: most device memory an offload may leave reserved in this process before it warns and
            sets ``OffloadStats.over_budget`` (module doc; None: not checked).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        pin_memory: bool | None = None,
        release_device_cache: bool = True,
        device_budget_bytes: int | None = DEFAULT_DEVICE_BUDGET_BYTES,
    ) -> None:
        self.model = model
        self.device_budget_bytes = device_budget_bytes
        self.last_offload: OffloadStats | None = None
        self.optimizer = optimizer
        self.release_device_cache = release_device_cache
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._host: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor, torch.Size, torch.device]] = []
        self._checksum: str | None = None
        self.allocations = 0
        self.cycles = 0

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded)

    def _buffer(self, numel: int, dtype: torch.dtype, index: dict) -> torch.Tensor:
        """The ``index[key]``-th reusable host buffer of that size and dtype (allocated on first use)."""
        key = (numel, dtype)
        pool = self._host.setdefault(key, [])
        i = index.get(key, 0)
        index[key] = i + 1
        if i == len(pool):
            pool.append(torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory))
            self.allocations += 1
        return pool[i]

    def offload(self) -> OffloadStats:
        """Move state to host buffers, free device storage and return the caching allocator's free memory to the
        driver (``torch.cuda.empty_cache()`` where CUDA is initialised, so another process, e.g. the sampler
        waking, can use it); returns the figures, with the device memory still reserved by this process.

        Raises:
            RuntimeError: already offloaded.
        """
        if self._offloaded:
            raise RuntimeError("trainer state is already offloaded")
        t0 = time.perf_counter()
        index: dict = {}
        moved = 0
        tensors = _tensors(self.model, self.optimizer)
        on_host = all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        checksum = "" if on_host else _combine([tensor_checksum(t) for t in tensors])  # on a device: before copy-out
        pairs = []
        for t in tensors:
            flat = t.detach().reshape(-1)
            buf = self._buffer(flat.numel(), t.dtype, index)
            if on_host:
                pairs.append((buf, flat))
            else:
                buf.copy_(flat, non_blocking=self.pin_memory)
            self._offloaded.append((t, buf, t.shape, t.device))
            moved += t.numel() * t.element_size()
        if on_host:  # copy and checksum in one pass over memory
            checksum = _combine(copy_many_with_checksums(pairs))
        self._checksum = checksum
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()
        with torch.no_grad():
            for t, _, _, device in self._offloaded:
                t.set_(torch.empty(0, dtype=t.dtype, device=device))  # free the working storage
        reserved = release_cached_device_memory() if self.release_device_cache else None
        if reserved is None and torch.cuda.is_initialized():
            reserved = int(torch.cuda.memory_reserved())
        allocated = int(torch.cuda.memory_allocated()) if reserved is not None else None
        self.cycles += 1
        stats = OffloadStats(moved, time.perf_counter() - t0, checksum, self.allocations, reserved, allocated)
        budget = self.device_budget_bytes
        if budget is not None and reserved is not None and reserved > budget:
            stats.over_budget = (
                f"the trainer's offload left {reserved / 2**30:.2f} GiB reserved on the device ({(allocated or 0) / 2**30:.2f} "
                f"GiB of it in live tensors), over its budget of {budget / 2**30:.2f} GiB: the sampler waking next may "
                "run out of memory; free what else the process holds on the device (other tensors, CUDA graphs) "
                "before yielding"
            )
            log.warning("%s", stats.over_budget)
        self.last_offload = stats
        return stats

    def restore(self) -> OffloadStats:
        """Copy state back into fresh device storage and verify the checksum.

        Raises:
            StateNotOffloaded: nothing is offloaded.
            StateChecksumMismatch: the host copy changed; the state stays offloaded.
        """
        if not self._offloaded:
            raise StateNotOffloaded("restore() called but the trainer state is not offloaded")
        t0 = time.perf_counter()
        moved = 0
        fresh_tensors = []
        on_host: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t, buf, shape, device in self._offloaded:
            fresh = torch.empty(shape, dtype=t.dtype, device=device)
            if device.type == "cpu":
                on_host.append((fresh.view(-1), buf))
            else:
                fresh.view(-1).copy_(buf, non_blocking=self.pin_memory)
            fresh_tensors.append(fresh)
            moved += buf.numel() * buf.element_size()
        # On the host: copy and checksum of the bytes as written, in one pass over memory.
        sums = copy_many_with_checksums(on_host, sum_dst=True) if on_host else []
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()
        if len(sums) != len(fresh_tensors):  # on an accelerator: on the device, after copy-in
            sums = [tensor_checksum(f) for f in fresh_tensors]
        got = _combine(sums)
        if got != self._checksum:
            raise StateChecksumMismatch(
                f"trainer state checksum {got} differs from the offloaded {self._checksum}; "
                "host memory was corrupted or modified: restart the job from its last checkpoint"
            )
        with torch.no_grad():
            for (t, _, _, _), fresh in zip(self._offloaded, fresh_tensors, strict=True):
                t.set_(fresh)
        self._offloaded.clear()
        return OffloadStats(moved, time.perf_counter() - t0, got, self.allocations)
