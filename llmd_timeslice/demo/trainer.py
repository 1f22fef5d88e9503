"""The demo's trainer: a reward-weighted policy-gradient step on the tiny Llama, on CPU.

The policy is the same tiny model the samplers serve, loaded with ``transformers``; each step
raises the log-likelihood of completions in proportion to their (centred) reward, GRPO-style.
The reward is deliberately simple: the share of letters and spaces in a completion.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def reward(text: str) -> float:
    """Share of ASCII letters and spaces in ``text`` (0..1): rewards readable output; 0 for empty text."""
    return sum(c.isascii() and (c.isalpha() or c == " ") for c in text) / len(text) if text else 0.0


class Trainer:
    """Policy + AdamW optimizer over the model in ``model_dir``."""

    def __init__(self, model_dir: Path, lr: float = 1e-4) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        torch.set_num_threads(1)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.steps = 0

    def step(self, prompts: list[str], completions: list[str], min_seconds: float = 0.0) -> dict:
        """Optimizer steps on one rollout batch, repeated until ``min_seconds`` passed; returns figures."""
        rewards = torch.tensor([reward(c) for c in completions])
        adv = rewards - rewards.mean()
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        enc = self.tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=128)
        t0 = time.perf_counter()
        n = 0
        while True:
            out = self.model(**enc, labels=None)
            logp = torch.log_softmax(out.logits[:, :-1], dim=-1)
            tgt = enc["input_ids"][:, 1:]
            tok_logp = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) * enc["attention_mask"][:, 1:]
            loss = -(adv.unsqueeze(1) * tok_logp).sum() / enc["attention_mask"].sum()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            n += 1
            self.steps += 1
            if time.perf_counter() - t0 >= min_seconds:
                break
        return {
            "loss": loss.item(),
            "reward_mean": rewards.mean().item(),
            "optimizer_steps": n,
            "train_s": time.perf_counter() - t0,
        }
