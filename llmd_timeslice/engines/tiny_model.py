"""Build a tiny, randomly initialised Llama model that vLLM can serve on CPU.

No model hub is reachable from the demo/test machines, so the model is created
locally: a ``transformers`` ``LlamaForCausalLM`` with random weights and a small
byte-level BPE tokenizer trained with the ``tokenizers`` library on an English
corpus generated in code. The output is a normal Hugging Face model directory
(``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) that ``vllm serve``/the OpenAI API server can load. The
tokenizer carries a minimal chat template (:data:`CHAT_TEMPLATE`), so ``/v1/chat/completions`` works too.

The text it generates is gibberish; it exists only to exercise serving paths.

Model shape (all sizes in elements, not bytes):

* ``hidden_size`` 128, ``num_attention_heads`` 2 → ``head_dim`` 64. vLLM's CPU
  attention kernels refuse small head sizes such as 16, so 64 is required.
* ``num_key_value_heads`` 2, ``num_hidden_layers`` 2, ``intermediate_size`` 256.
* ``max_position_embeddings`` 512 tokens.
* ``vocab_size`` = the trained tokenizer's vocabulary size (≤ ``VOCAB_SIZE``).
* weights stored as float32 (~0.5 M parameters, ~2 MB on disk).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

#: Target BPE vocabulary size (tokens), special tokens included.
VOCAB_SIZE = 768
#: Special tokens; ids 0, 1, 2 in this order.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
#: Written last; its presence (with a matching seed) marks a complete build.
_MARKER = ".tiny_llama_complete.json"
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_BUILD_VERSION = 2  # 2: the tokenizer has a chat template (weights unchanged for a given seed)
#: Environment variable naming the cache of finished builds (:func:`tiny_model_cache_dir`); empty disables it.
CACHE_ENV_VAR = "LLMD_TIMESLICE_TINY_MODEL_CACHE"
#: Chat template (Jinja, as ``transformers`` and vLLM's ``/v1/chat/completions`` apply it): one ``role: content``
#: line per message, then ``assistant:`` when a generation prompt is asked for. Only what chat APIs need.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_SUBJECTS = (
    "the cat",
    "a dog",
    "my friend",
    "the teacher",
    "our neighbour",
    "the old man",
    "a young girl",
    "the farmer",
    "the pilot",
    "a small bird",
    "the river",
    "the engineer",
    "the server",
    "a student",
    "the captain",
    "the baker",
)
_VERBS = (
    "runs",
    "walks",
    "sings",
    "reads",
    "writes",
    "jumps",
    "sleeps",
    "waits",
    "listens",
    "answers",
    "builds",
    "paints",
    "carries",
    "finds",
    "opens",
    "watches",
    "helps",
    "cooks",
    "counts",
    "moves",
)
_OBJECTS = (
    "a book",
    "the door",
    "a letter",
    "the window",
    "some bread",
    "a song",
    "the garden",
    "a red apple",
    "the long road",
    "a quiet room",
    "the map",
    "a warm coat",
    "the blue sky",
    "a wooden box",
    "the morning news",
)
_ADVERBS = (
    "slowly",
    "quickly",
    "today",
    "again",
    "every morning",
    "at night",
    "in the park",
    "near the sea",
    "after lunch",
    "before dinner",
    "with care",
    "without a word",
    "in the rain",
    "under the tree",
    "by the window",
)
_EXTRA = (
    "hello world. hello there. good morning. good night. thank you very much.",
    "one two three four five six seven eight nine ten eleven twelve.",
    "monday tuesday wednesday thursday friday saturday sunday.",
    "spring summer autumn winter. north south east west.",
    "the quick brown fox jumps over the lazy dog.",
    "a model serves tokens; a request waits in the queue; the engine sleeps.",
    "The Server Is Awake. The Server Is Asleep. Time Slice, Wake Up!",
)


def _corpus(seed: int, n_sentences: int = 400) -> list[str]:
    """Deterministic English-like training text: ``n_sentences`` lines.

    Roughly 6 words per sentence, so the default is a few thousand words built
    from a vocabulary of a few hundred distinct words.
    """
    rng = random.Random(seed)
    lines = list(_EXTRA)
    for _ in range(n_sentences):
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ADVERBS)}."
        lines.append(sentence.capitalize() if rng.random() < 0.5 else sentence)
    return lines


def _is_complete(out_dir: Path, seed: int) -> bool:
    """True if ``out_dir`` holds a finished build for ``seed``."""
    marker = out_dir / _MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if meta != {"seed": seed, "version": _BUILD_VERSION}:
        return False
    return all((out_dir / name).is_file() for name in _REQUIRED_FILES)


def _train_tokenizer(seed: int):
    """Train a byte-level BPE tokenizer; returns a ``PreTrainedTokenizerFast``.

    Vocabulary: ≤ ``VOCAB_SIZE`` tokens, ids 0/1/2 are ``<pad>``/``<s>``/``</s>``.
    A ``<s>`` (bos) token is prepended to every encoded sequence, as for Llama.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model_cache_dir() -> Path | None:
    """Where finished builds are kept for reuse: ``$LLMD_TIMESLICE_TINY_MODEL_CACHE`` (empty: no cache), else
    ``$XDG_CACHE_HOME/llmd-timeslice/tiny-llama`` (``~/.cache/...`` without it)."""
    value = os.environ.get(CACHE_ENV_VAR)
    if value is not None:
        return Path(value) if value else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmd-timeslice" / "tiny-llama"


def _library_key() -> str:
    """The versions a build's bytes depend on (tokenizer training, weight init, serialisation), without importing
    them."""
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for dist in ("torch", "transformers", "tokenizers", "safetensors"):
        try:
            parts.append(f"{dist}-{version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist}-none")
    return "_".join(parts).replace("+", "-")


def build_tiny_llama(out_dir: Path, seed: int = 0, use_cache: bool = True) -> Path:
    """Create (or reuse) a tiny random Llama model directory for vLLM.

    Args:
        out_dir: destination directory; created if missing. Files written:
            ``config.json``, ``generation_config.json``, ``model.safetensors``,
            ``tokenizer.json``, ``tokenizer_config.json`` (+ whatever else
            ``save_pretrained`` emits) and a completion marker.
        seed: seeds both the training corpus and the weight initialisation;
            the same seed yields byte-identical files.
        use_cache: copy a finished build for ``seed`` from :func:`tiny_model_cache_dir` (building it there first
            when missing), keyed by the versions of torch, transformers, tokenizers and safetensors. A build imports
            torch and transformers and trains the tokenizer; a copy only copies files (docs/benchmarks.md#code-figures). Each
            ``llmd-timeslice up`` workdir, demo run and test session gets its own copy (RL examples train it).

    Returns:
        ``out_dir`` (as a ``Path``). If it already holds a complete build for
        ``seed`` the function returns immediately without importing torch.

    Files are first written to a temporary sibling directory and then moved
    into ``out_dir`` one by one, with the marker last, so an interrupted build
    (or copy) is never mistaken for a complete one.
    """
    out_dir = Path(out_dir)
    if _is_complete(out_dir, seed):
        return out_dir
    cache = tiny_model_cache_dir() if use_cache else None
    if cache is None:
        return _build(out_dir, seed)
    cached = cache / f"seed-{seed}-v{_BUILD_VERSION}-{_library_key()}"
    if not _is_complete(cached, seed):
        _build(cached, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        for name in sorted(n.name for n in cached.iterdir() if n.is_file() and n.name != _MARKER):
            shutil.copy2(cached / name, Path(tmp) / name)
        _move_in(Path(tmp), out_dir, seed)
    return out_dir


def _move_in(tmp_dir: Path, out_dir: Path, seed: int) -> None:
    """Move a finished build's files from ``tmp_dir`` into ``out_dir``, the completion marker last."""
    (out_dir / _MARKER).unlink(missing_ok=True)
    for src in sorted(tmp_dir.iterdir()):
        src.chmod(0o644)  # safetensors writes 0600 files
        os.replace(src, out_dir / src.name)
    (out_dir / _MARKER).write_text(json.dumps({"seed": seed, "version": _BUILD_VERSION}))


def _build(out_dir: Path, seed: int) -> Path:
    """Build the model for ``seed`` into ``out_dir`` (see :func:`build_tiny_llama`)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        tmp_dir = Path(tmp)
        model.save_pretrained(tmp_dir, safe_serialization=True)
        generation_config.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        _move_in(tmp_dir, out_dir, seed)
    return out_dir


#: Modules a tiny LoRA adapter targets (the attention projections of every layer).
LORA_TARGET_MODULES = ("q_proj", "v_proj")


def build_tiny_lora(model_dir: Path, out_dir: Path, seed: int = 1, rank: int = 8, scale: float = 0.5) -> Path:
    """Write a LoRA adapter for the tiny Llama in ``model_dir`` to ``out_dir``, in PEFT's on-disk format.

    Files: ``adapter_config.json`` (``peft_type`` LORA, ``r`` = ``rank``, ``lora_alpha`` = ``rank`` (scaling 1),
    ``target_modules`` = :data:`LORA_TARGET_MODULES`) and ``adapter_model.safetensors`` with, per layer ``i`` and
    module ``m``, ``base_model.model.model.layers.{i}.self_attn.{m}.lora_A.weight`` (``rank`` × in features) and
    ``...lora_B.weight`` (out features × ``rank``), float32. The names and fields are the ones vLLM 0.32 reads
    (``vllm/lora/peft_helper.py`` ``PEFTHelper``, ``parse_fine_tuned_lora_name`` in ``vllm/lora/utils.py``); peft
    itself is not needed. Unlike PEFT's initialisation (``lora_B`` = 0: a no-op until trained) both matrices are
    random, entries ~ N(0, ``scale``²): the adapter changes the model's greedy tokens, so a test can tell its answers
    from the base model's. The same seed gives identical files; a directory already holding them (its marker names
    the same base model and parameters) is returned without importing torch. Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    params = {"seed": seed, "rank": rank, "scale": scale, "base": config, "version": 1}
    marker = out_dir / ".tiny_lora_complete.json"
    if marker.is_file() and (out_dir / "adapter_model.safetensors").is_file():
        try:
            if json.loads(marker.read_text()) == params:
                return out_dir
        except ValueError:
            pass
    import torch
    from safetensors.torch import save_file

    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    out_features = {
        "q_proj": int(config["num_attention_heads"]) * head_dim,
        "v_proj": int(config["num_key_value_heads"]) * head_dim,
    }
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for m in LORA_TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features[m], rank, generator=gen) * scale
    out_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_model.safetensors").chmod(0o644)  # safetensors writes 0600 files
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_TARGET_MODULES),
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    marker.write_text(json.dumps(params))  # last: an interrupted build is built again
    return out_dir
