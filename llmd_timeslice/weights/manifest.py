"""Weight directories with a checksum manifest: written by the trainer, verified by the sidecar before a load.

Layout of one version (``save_weight_version(model, root, 7)`` -> ``root/v7/``)::

    root/v7/model.safetensors              (or several shards + index, as ``save_pretrained`` writes them)
    root/v7/config.json ...
    root/v7/weights-manifest.json          {"format": "llmd-timeslice-weights/v1", "version": 7,
                                            "algorithm": "sha256",
                                            "files": {"model.safetensors": {"bytes": N, "sha256": "..."}}}

The directory is written under a temporary name and renamed into place, so a sampler never sees a
half-written version. The checksum is SHA-256 (``hashlib``, OpenSSL; 1.8 GB/s per core with SHA-NI on
the development machine, about a memory copy: docs/decisions.md); files are hashed on a thread pool.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmd_timeslice.weights.update import SOURCE_FILES, WeightUpdate

MANIFEST_NAME = "weights-manifest.json"
MANIFEST_FORMAT = "llmd-timeslice-weights/v1"
_CHUNK = 8 << 20


class WeightManifestError(Exception):
    """A weight directory does not match its manifest (missing, extra-short or corrupt file, wrong
    version, no manifest). The message names the file and what to do."""


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _threads(n_files: int) -> int:
    return max(1, min(n_files, os.cpu_count() or 1, 8))


def write_manifest(directory: str | os.PathLike, version: int) -> dict:
    """Hash every regular file of ``directory`` (not the manifest itself) and write the manifest.

    Returns the manifest (a dict, as written). Raises ``ValueError`` for a version < 1.
    """
    if version < 1:
        raise ValueError(f"weight version must be >= 1, got {version}")
    d = Path(directory)
    files = sorted(p for p in d.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    with ThreadPoolExecutor(_threads(len(files))) as pool:
        digests = list(pool.map(_sha256, files))
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": version,
        "algorithm": "sha256",
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": h} for p, h in zip(files, digests, strict=True)},
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
    if m.get("algorithm") != "sha256":
        raise WeightManifestError(f"{p}: unsupported checksum algorithm {m.get('algorithm')!r} (sha256 only)")
    return m


def verify_weights(directory: str | os.PathLike, version: int | None = None) -> int:
    """Check every file listed in the manifest of ``directory`` (size, then SHA-256) and, with
    ``version``, that the manifest is that version. Returns the bytes verified.

    Raises:
        WeightManifestError: naming the first file that is missing, of the wrong size or corrupt.
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
    entries = sorted(m["files"].items())
    if not any(name.endswith(".safetensors") for name, _ in entries):
        raise WeightManifestError(f"{d}: the manifest lists no .safetensors file")
    for name, e in entries:
        p = d / name
        if "/" in name or name.startswith("."):
            raise WeightManifestError(f"{d / MANIFEST_NAME}: file name {name!r} is not a plain file name")
        if not p.is_file():
            raise WeightManifestError(f"{p} is listed in the manifest but missing")
        if p.stat().st_size != e.get("bytes"):
            raise WeightManifestError(
                f"{p} has {p.stat().st_size} bytes, the manifest says {e.get('bytes')}: a partial copy? write the version again"
            )
    with ThreadPoolExecutor(_threads(len(entries))) as pool:
        digests = list(pool.map(_sha256, [d / name for name, _ in entries]))
    for (name, e), h in zip(entries, digests, strict=True):
        if h != e.get("sha256"):
            raise WeightManifestError(
                f"{d / name} does not match its sha256 in the manifest: corrupt or changed "
                "after publishing; write the version again"
            )
    return sum(int(e["bytes"]) for _, e in entries)


DEFAULT_SHARD_BYTES = 256 << 20
"""Shards of at most this many bytes: the manifest check hashes shards on parallel threads (one file would be
one core's SHA-256 speed)."""


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
