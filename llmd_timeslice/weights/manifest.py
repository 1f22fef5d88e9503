"""Weight directories with a checksum manifest: written by the trainer, verified by the sidecar before a load.

Layout of one version (``save_weight_version(model, root, 7)`` -> ``root/v7/``)::

    root/v7/model.safetensors              (or several shards + index, as ``save_pretrained`` writes them)
    root/v7/config.json ...
    root/v7/weights-manifest.json          {"format": "llmd-timeslice-weights/v1", "version": 7,
                                            "algorithm": "xxh3_128",
                                            "files": {"model.safetensors": {"bytes": N, "xxh3_128": "..."}}}

The directory is written under a temporary name and renamed into place, so a sampler never sees a
half-written version. The checksum is XXH3-128 (``xxhash``): what it guards against is accidental damage
(a partial copy, a flipped bit, a file rewritten in place), not an adversary who can write the volume, and
it hashes at memory speed, several times faster than SHA-256 per core (docs/decisions/weight-versions-check.md; the
figures: docs/weights.md). Manifests that name ``sha256`` still verify. Files are hashed on a thread pool, one file
per thread; the sidecar runs the hashing while vLLM reads the same files (:func:`check_weight_files` first, then
:meth:`CheckedWeights.verify_contents` alongside the reload: docs/weights.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from llmd_timeslice.weights.update import SOURCE_FILES, WeightUpdate

MANIFEST_NAME = "weights-manifest.json"
MANIFEST_FORMAT = "llmd-timeslice-weights/v1"
_CHUNK = 8 << 20

ALGORITHMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Checksum name (the manifest's ``algorithm``, and each file entry's key) -> hash constructor."""
DEFAULT_ALGORITHM = "xxh3_128"
"""What :func:`write_manifest` writes: XXH3-128 (``xxhash``), a non-cryptographic 128-bit checksum against
accidental damage (a partial copy, a flipped bit, a file rewritten in place), at memory speed per core;
manifests that name ``sha256`` (every version written before it) still verify."""


class WeightManifestError(Exception):
    """A weight directory does not match its manifest (missing, extra-short or corrupt file, wrong
    version, no manifest). The message names the file and what to do."""


def _digest(path: Path, algorithm: str) -> str:
    h = ALGORITHMS[algorithm]()
    buf = memoryview(bytearray(_CHUNK))
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def _threads(n_files: int) -> int:
    return max(1, min(n_files, os.cpu_count() or 1, 8))


def write_manifest(directory: str | os.PathLike, version: int, algorithm: str = DEFAULT_ALGORITHM) -> dict:
    """Hash every regular file of ``directory`` (not the manifest itself) with ``algorithm`` (a key of
    :data:`ALGORITHMS`) and write the manifest.

    Returns the manifest (a dict, as written). Raises ``ValueError`` for a version < 1 or an unknown algorithm.
    """
    if version < 1:
        raise ValueError(f"weight version must be >= 1, got {version}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    d = Path(directory)
    files = sorted(p for p in d.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    with ThreadPoolExecutor(_threads(len(files))) as pool:
        digests = list(pool.map(lambda p: _digest(p, algorithm), files))
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": version,
        "algorithm": algorithm,
        "files": {p.name: {"bytes": p.stat().st_size, algorithm: h} for p, h in zip(files, digests, strict=True)},
    }
    (d / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of ``directory``. Raises :class:`WeightManifestError` if absent or malformed."""
    p = Path(directory) / MANIFEST_NAME
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        raise WeightManifestError(
            f"{p} does not exist: was the version written with save_weight_version / "
            "write_manifest, and is the volume mounted in the sampler pod?"
        ) from None
    except (OSError, ValueError) as exc:
        raise WeightManifestError(f"{p} cannot be read: {exc}") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), dict):
        raise WeightManifestError(f"{p} is not a {MANIFEST_FORMAT} manifest")
    if m.get("algorithm") not in ALGORITHMS:
        raise WeightManifestError(f"{p}: unsupported checksum algorithm {m.get('algorithm')!r} (known: {', '.join(ALGORITHMS)})")
    return m


def _check_safetensors_header(p: Path, size: int) -> None:
    """The safetensors header (u64 little-endian length, then JSON) parses and its tensors end exactly at the end
    of the file (the safetensors format, huggingface/safetensors README "Format"). Raises WeightManifestError."""
    try:
        with p.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
        ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"]
        if max(ends, default=0) + 8 + n != size:
            raise ValueError("its tensors do not end at the end of the file")
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise WeightManifestError(
            f"{p} is not a readable safetensors file ({exc}): damaged after publishing; write the version again"
        ) from None


@dataclass(frozen=True)
class CheckedWeights:
    """A weight directory whose manifest, file names, sizes and safetensors headers are checked
    (:func:`check_weight_files`); :meth:`verify_contents` checks the bytes."""

    directory: Path
    algorithm: str
    files: tuple[tuple[str, str], ...]  # (name, expected digest)
    bytes: int

    def verify_contents(self) -> int:
        """Hash every file (one thread per file, up to 8: hashlib and xxhash release the GIL) and compare with the
        manifest. Returns the bytes verified. Raises :class:`WeightManifestError` naming the first file that differs."""
        with ThreadPoolExecutor(_threads(len(self.files))) as pool:
            digests = list(pool.map(lambda f: _digest(self.directory / f[0], self.algorithm), self.files))
        for (name, want), got in zip(self.files, digests, strict=True):
            if got != want:
                raise WeightManifestError(
                    f"{self.directory / name} does not match its {self.algorithm} in the manifest: corrupt or changed "
                    "after publishing; write the version again"
                )
        return self.bytes


def check_weight_files(directory: str | os.PathLike, version: int | None = None) -> CheckedWeights:
    """The quick part of the check, no hashing: the manifest of ``directory`` (and, with ``version``, that it is
    that version), every listed file present with its size, every ``.safetensors`` header readable (what a
    vLLM 0.32 ``reload_weights`` would die on). Returns what :meth:`CheckedWeights.verify_contents` hashes.

    Raises:
        WeightManifestError: naming the first file that is missing, of the wrong size or damaged.
    """
    d = Path(directory)
    if not d.is_dir():
        raise WeightManifestError(f"weight directory {d} does not exist (or is not a directory) on this node")
    m = read_manifest(d)
    if version is not None and m.get("version") != version:
        raise WeightManifestError(
            f"{d / MANIFEST_NAME} is version {m.get('version')!r}, the update says {version}; "
            "publish the directory that holds that version"
        )
    algorithm = m["algorithm"]
    entries = sorted(m["files"].items())
    if not any(name.endswith(".safetensors") for name, _ in entries):
        raise WeightManifestError(f"{d}: the manifest lists no .safetensors file")
    for name, e in entries:
        p = d / name
        if "/" in name or name.startswith("."):
            raise WeightManifestError(f"{d / MANIFEST_NAME}: file name {name!r} is not a plain file name")
        if not isinstance(e, dict) or not isinstance(e.get(algorithm), str):
            raise WeightManifestError(f"{d / MANIFEST_NAME}: the entry of {name!r} has no {algorithm} digest")
        if not p.is_file():
            raise WeightManifestError(f"{p} is listed in the manifest but missing")
        size = p.stat().st_size
        if size != e.get("bytes"):
            raise WeightManifestError(
                f"{p} has {size} bytes, the manifest says {e.get('bytes')}: a partial copy? write the version again"
            )
        if name.endswith(".safetensors"):
            _check_safetensors_header(p, size)
    return CheckedWeights(d, algorithm, tuple((n, e[algorithm]) for n, e in entries), sum(int(e["bytes"]) for _, e in entries))


def verify_weights(directory: str | os.PathLike, version: int | None = None) -> int:
    """Check every file listed in the manifest of ``directory`` (:func:`check_weight_files`, then the checksum of
    every byte) and, with ``version``, that the manifest is that version. Returns the bytes verified.

    Raises:
        WeightManifestError: naming the first file that is missing, of the wrong size or corrupt.
    """
    return check_weight_files(directory, version).verify_contents()


DEFAULT_SHARD_BYTES = 256 << 20
"""Shards of at most this many bytes: the manifest check hashes shards on parallel threads (one file would be
one core's checksum speed)."""


def _save_state_dict(state: Mapping, directory: Path, shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for name, t in state.items():
        t = t.detach().contiguous().cpu()
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def save_weight_version(
    model_or_state_dict, root: str | os.PathLike, version: int, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> WeightUpdate:
    """Write weight version ``version`` under ``root/v{version}`` (safetensors + manifest), atomically.

    ``model_or_state_dict``: a ``transformers`` model (saved with ``save_pretrained``, config
    included) or a mapping of parameter name -> tensor (saved with ``safetensors.torch.save_file``).
    Files are sharded at ``shard_bytes`` (bytes). Returns the :class:`WeightUpdate` to publish.
    Raises ``FileExistsError`` if that version exists.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version}"
    if final.exists():
        raise FileExistsError(f"{final} exists: weight versions are immutable once published")
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=root))
    try:
        if isinstance(model_or_state_dict, Mapping):
            _save_state_dict(model_or_state_dict, tmp, shard_bytes)
        else:
            model_or_state_dict.save_pretrained(tmp, safe_serialization=True, max_shard_size=shard_bytes)
        write_manifest(tmp, version)
        os.chmod(tmp, 0o755)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return WeightUpdate(version, SOURCE_FILES, str(final))
