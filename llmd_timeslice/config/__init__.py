"""The configuration of every component: the schema (:mod:`~llmd_timeslice.config.schema`: one section per
component, the layering of file, environment and flags, the checks) and the generated Markdown reference
(:mod:`~llmd_timeslice.config.reference`, docs/configuration.md). The names are re-exported here, where they were
imported from before the split."""

from llmd_timeslice.config.reference import reference_markdown
from llmd_timeslice.config.schema import (
    ENV_DELIMITER,
    ENV_PREFIX,
    SECTIONS,
    Flag,
    GateSettings,
    KubernetesDiscoverySettings,
    LogLevel,
    OrchestratorSettings,
    PickerSettings,
    Port,
    Seconds,
    SidecarSettings,
    TimesliceConfig,
    json_schema,
    parse_duration,
    summary_lines,
)
from llmd_timeslice.config.sources import (
    CliField,
    ConfigError,
    cli_fields,
    component_settings,
    component_token_origin,
    load_config,
)

__all__ = [
    "ENV_DELIMITER",
    "ENV_PREFIX",
    "SECTIONS",
    "CliField",
    "ConfigError",
    "Flag",
    "GateSettings",
    "KubernetesDiscoverySettings",
    "LogLevel",
    "OrchestratorSettings",
    "PickerSettings",
    "Port",
    "Seconds",
    "SidecarSettings",
    "TimesliceConfig",
    "cli_fields",
    "component_settings",
    "component_token_origin",
    "json_schema",
    "load_config",
    "parse_duration",
    "reference_markdown",
    "summary_lines",
]
