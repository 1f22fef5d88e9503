"""The label fallback's EPP flow control: the values for the chart's default plugins, the queue-wait budget per EPP
version, and flow control layered onto a release's own EndpointPickerConfig (``generate.py --flow-control-values``)."""

from __future__ import annotations

import yaml

from llmd_timeslice import yaml_files
from manifests.families.common import (
    HEADER,
    GuideSettings,
    _dump,
    _dur,
    _indent,
)

EPP_HAS_NO_ENDPOINT_REQUEST_TTL: dict[str, bool] = {
    # llm-d-router apix/config/v1alpha1/endpointpickerconfig_types.go, FlowControlConfig. noEndpointRequestTTL
    # (#2284, bba90136ff12, 2026-08-18, on main) bounds the queue wait while the pool has NO endpoints; without it
    # defaultRequestTTL bounds both regimes. No release up to v0.10.0 (71f4f0999f95) has it.
    "v0.9.0": False,
    "v0.10.0": False,
}
"""EPP version -> whether its EndpointPickerConfig has ``flowControl.noEndpointRequestTTL`` (versions checked)."""


def flow_control_ttl(s: GuideSettings, epp_version: str | None = None) -> dict[str, str]:
    """The label fallback's queue-wait budget for ``epp_version``: the hold of an empty pool (every sampler asleep)
    is ``max_hold_s``. Where the EPP has ``noEndpointRequestTTL``, only that is set, so a saturated pool keeps the
    EPP's own ``defaultRequestTTL`` (60 s unless the release sets one) and is shed early; before it, the one
    ``defaultRequestTTL`` must be ``max_hold_s``, which also lets a saturated pool queue that long.

    Raises:
        ValueError: ``epp_version`` is not in :data:`EPP_HAS_NO_ENDPOINT_REQUEST_TTL` (not checked: read its
            ``FlowControlConfig`` and add it).
    """
    epp_version = epp_version or EPP_VERSION
    if epp_version not in EPP_HAS_NO_ENDPOINT_REQUEST_TTL:
        raise ValueError(
            f"llm-d-router {epp_version}: not checked for flowControl.noEndpointRequestTTL (llm-d-router #2284); "
            "read its apix/config/v1alpha1/endpointpickerconfig_types.go and add it to EPP_HAS_NO_ENDPOINT_REQUEST_TTL"
        )
    key = "noEndpointRequestTTL" if EPP_HAS_NO_ENDPOINT_REQUEST_TTL[epp_version] else "defaultRequestTTL"
    return {key: _dur(s.max_hold_s)}


def values_flow_control(s: GuideSettings) -> str:
    epc = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "featureGates": ["flowControl"],
        "flowControl": flow_control_ttl(s),
        "plugins": [{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"}, {"type": "prefix-cache-scorer"}],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                ],
            }
        ],
    }
    text = _dump(epc)
    return (
        HEADER + "# Label fallback only (no gate on the request path): the EPP's flow control holds requests while\n"
        f"# the pool is empty (every sampler asleep) for up to {s.max_hold_s:g} s (max_hold_s), then answers 503\n"
        "# (x-llm-d-request-dropped-reason: rejected-ttl-expired on v0.9.0, rejected-no-endpoints from v0.10.0).\n"
        f"# llm-d-router {EPP_VERSION} has one TTL for both regimes, so a saturated pool also queues that long\n"
        "# (then 429 rejected-ttl-expired from v0.10.0); noEndpointRequestTTL (#2284, after v0.10.0) splits it.\n"
        "# Layer after values-gateway.yaml and values-serving-label.yaml, ONLY for a release that sets no\n"
        "# EndpointPickerConfig of its own (the chart's default plugins, below). A guide's release has its own:\n"
        "# `generate.py --flow-control-values` layers flow control onto it instead (guide README).\n"
        "router:\n"
        "  epp:\n"
        "    pluginsConfigFile: timeslice-flow-control.yaml\n"
        "    pluginsCustomConfig:\n"
        "      timeslice-flow-control.yaml: |\n" + _indent(text, 8)
    )


EPP_VERSION = "v0.10.0"
"""The EPP the guide is written and checked for (llm-d-router v0.10.0, 71f4f0999f95: the chart version and EPP image the
guide pins, router/values-pins.yaml)."""

EPP_PLUGIN_PARAMETERS: dict[str, frozenset[str]] = {
    # llm-d-router v0.10.0 (71f4f0999f95; compared with v0.9.0, 5f4e762f341a, which lacks the parameters marked
    # "v0.10.0"): each plugin's parameters struct (json tags). The EPP decodes them strictly
    # (pkg/epp/framework/interface/plugin/registry.go StrictDecoder: DisallowUnknownFields): an unknown one stops it.
    # pkg/epp/framework/plugins/scheduling/scorer/tokenload/token_load.go
    "token-load-scorer": frozenset({"queueThresholdTokens", "inFlightLoadProducerName"}),
    # pkg/epp/framework/plugins/requestcontrol/dataproducer/inflightload/producer.go
    "inflight-load-producer": frozenset(
        {
            "addEstimatedOutputTokens",
            "prefixMatchInfoProducerName",
            "outputRatio",  # v0.10.0
            "maxEstimatedOutputTokens",  # v0.10.0
            "syncCrossReplicaState",  # v0.10.0
        }
    ),
    # pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go
    "approx-prefix-cache-producer": frozenset(
        {"autoTune", "blockSizeTokens", "blockSize", "maxPrefixBlocksToMatch", "maxPrefixTokensToMatch", "lruCapacityPerServer"}
    ),
    # pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go (maxTokensInFlightPenalty was removed
    # by #1547, afdf6bcf5, before v0.9.0)
    "prefix-cache-affinity-filter": frozenset(
        {
            "affinityThreshold",
            "explorationProbability",
            "maxTTFTPenaltyMs",
            "ttftSource",
            "peakPrefillThroughput",
            "prefixMatchInfoProducerName",
            "latencyPredictionInfoProducerName",
            "inFlightLoadProducerName",
        }
    ),
    # pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go, kvcacheutilization/kvcache_utilization.go: none
    "queue-scorer": frozenset(),
    "kv-cache-utilization-scorer": frozenset(),
    # pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go
    "prefix-cache-scorer": frozenset(
        {"prefixMatchInfoProducerName", "matchLengthWeight", "matchLengthScaleTokens"}  # the last two: v0.10.0
    ),
}
"""Plugin type -> the parameters the pinned EPP knows (tests/manifests/test_gateway_routes.py checks every EPP config we render or
cite against it)."""


def epp_config_errors(epc: dict) -> list[str]:
    """What the pinned EPP would refuse in EndpointPickerConfig ``epc``: a plugin parameter it does not have, or a
    plugin type this table does not know (then nothing says it would start)."""
    errors = []
    for plugin in epc.get("plugins") or []:
        kind = plugin.get("type")
        known = EPP_PLUGIN_PARAMETERS.get(kind)
        if known is None:
            errors.append(f"plugin {kind!r}: not in EPP_PLUGIN_PARAMETERS (llm-d-router {EPP_VERSION}): check its parameters")
            continue
        for name in sorted(set(plugin.get("parameters") or {}) - known):
            errors.append(
                f"plugin {plugin.get('name', kind)!r} ({kind}): parameter {name!r} is unknown to llm-d-router "
                f"{EPP_VERSION}, whose EPP decodes parameters strictly and would not start"
            )
    return errors


def flow_control_values(s: GuideSettings, release_values: dict) -> str:
    """Label fallback: the release's own EndpointPickerConfig (``router.epp.pluginsCustomConfig`` under its
    ``pluginsConfigFile``, as ``helm get values`` gives it) with flow control layered on: the ``flowControl`` feature
    gate added to its ``featureGates``, the empty-pool hold = ``max_hold_s`` (:func:`flow_control_ttl`: its
    ``noEndpointRequestTTL`` where the pinned EPP has it, else ``defaultRequestTTL``; its other flowControl keys
    kept). Every plugin and scheduling profile of the guide stays as it is. Raises ValueError when the release has
    no EndpointPickerConfig of its own (then ``values-flow-control.yaml``, written for the chart's default plugins)."""
    epp = ((release_values or {}).get("router") or {}).get("epp") or {}
    name, custom = epp.get("pluginsConfigFile"), epp.get("pluginsCustomConfig") or {}
    if not name or name not in custom:
        raise ValueError(
            "the release sets no router.epp.pluginsCustomConfig[router.epp.pluginsConfigFile]: "
            "use router/values-flow-control.yaml (the chart's default plugins)"
        )
    try:
        epc = yaml_files.load(custom[name])
    except yaml.YAMLError as exc:
        raise ValueError(f"router.epp.pluginsCustomConfig[{name}] is not YAML: {exc}") from exc
    if not isinstance(epc, dict) or epc.get("kind") != "EndpointPickerConfig":
        raise ValueError(f"router.epp.pluginsCustomConfig[{name}] is not an EndpointPickerConfig")
    errors = epp_config_errors(epc)
    if errors:
        raise ValueError(f"router.epp.pluginsCustomConfig[{name}]: {errors[0]}")
    gates = list(epc.get("featureGates") or [])
    if "flowControl" not in gates:
        gates.append("flowControl")
    epc["featureGates"] = gates
    epc["flowControl"] = {**(epc.get("flowControl") or {}), **flow_control_ttl(s)}
    return (
        "# Printed by manifests/generate.py --flow-control-values: the release's EndpointPickerConfig with the\n"
        "# label fallback's flow control layered on (its plugins and scheduling profiles unchanged).\n"
        "router:\n"
        "  epp:\n"
        f"    pluginsConfigFile: {name}\n"
        "    pluginsCustomConfig:\n"
        f"      {name}: |\n" + _indent(_dump(epc), 8)
    )
