"""``verifiers`` environments rolling out through the router (the library's classic environments, 0.3.x).

A classic ``verifiers`` environment (``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``, ``vf.ToolEnv`` ...) generates
with a ``vf.Client`` that wraps an ``openai.AsyncOpenAI`` client (``verifiers/legacy/clients``, verifiers 0.3.1):
``env.generate(inputs, client=..., model=...)``. :func:`verifiers_client` wraps the client of a
:class:`~llmd_timeslice.client.integrations.rollouts.TimeSliceRollouts`, so every rollout asks the gate for the current
weight version, rides out the gate's refusals, and is recorded under its ``trajectory_id`` (pass
``state_columns=["trajectory_id"]`` to ``generate`` to get it in the outputs). It overrides only
``get_response``, the per-model-call method of the public ``vf.Client`` interface, which receives the rollout's
``state``.

verifiers 0.4 removed these classic environments (its ``verifiers.v1`` stack runs harness programs against an
endpoint configured by ``base_url`` and ``headers``); see docs/integrations.md for what that means here.
"""

from __future__ import annotations

from llmd_timeslice.client.integrations.rollouts import TimeSliceRollouts

_APIS = ("chat", "completions")


def verifiers_client(rollouts: TimeSliceRollouts, api: str = "chat"):
    """A ``vf.Client`` for ``env.generate`` / ``env.evaluate``: ``api`` ``"chat"`` (chat completions) or
    ``"completions"``. Raises ValueError for another ``api``; ImportError when verifiers is not installed."""
    if api not in _APIS:
        raise ValueError(f"unknown api {api!r}; known: {', '.join(_APIS)}")
    import verifiers as vf

    base = vf.OpenAIChatCompletionsClient if api == "chat" else vf.OpenAICompletionsClient

    class _TimeSliceClient(base):  # type: ignore[misc, valid-type]
        async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            state = kwargs.get("state") or {}
            with rollouts.rollout(state.get("trajectory_id")):
                return await super().get_response(prompt, model, sampling_args, tools, **kwargs)

    _TimeSliceClient.__name__ = f"TimeSlice{base.__name__}"
    return _TimeSliceClient(rollouts.async_openai())
