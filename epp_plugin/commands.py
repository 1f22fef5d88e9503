"""The router side's commands of ``llmd-timeslice``: ``gate`` and ``picker``, added to the command through the entry
point group ``llmd_timeslice.commands`` (pyproject.toml; loaded by ``llmd_timeslice/cli.py``), so that the library
never imports this package (docs/decisions/process-code-layout.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from llmd_timeslice.component_process import (
    raise_open_file_limit,
    run_on_uvloop,
    run_until_signal,
    serve_metrics,
    setup_logging,
)
from llmd_timeslice.config import GateSettings, PickerSettings
from llmd_timeslice.settings_cli import settings_command


def register(app: typer.Typer) -> None:
    """Add ``gate`` and ``picker`` to ``app`` (the ``llmd-timeslice`` command)."""

    @settings_command(app, "gate", short_help="Run the time-slice gate (hold / drain / steer / release).")
    def gate(settings: GateSettings, token_file: Path | None) -> None:
        """Run the time-slice gate in front of the EPP (hold / drain / steer / release): Envoy ext_authz + access log
        (the fast path) or ext_proc. Mutual TLS of the control port: LLMD_TIMESLICE_TLS_*_FILE."""
        from epp_plugin.gate.server import GateConfig, serve
        from llmd_timeslice import tls
        from llmd_timeslice.auth import load_token

        setup_logging(settings.log_level)
        serve_metrics(settings.metrics_port, settings.host)
        raise_open_file_limit()
        cfg = GateConfig.from_settings(settings, token=load_token(token_file))
        from llmd_timeslice.discovery.kubernetes import KubernetesError

        try:
            run_on_uvloop(lambda: serve(cfg, tls.from_env()))
        except KubernetesError as exc:  # --kubeconfig names a file that cannot be loaded (bad input). The cluster's state
            # (no InferenceObjective CRD, RBAC, API server down) never ends the gate: bands off (docs/gate.md).
            typer.echo(f"llmd-timeslice: error: {exc}", err=True)
            raise typer.Exit(2) from None

    @settings_command(app, "picker", short_help="Run the EPP-protocol endpoint picker.")
    def picker(settings: PickerSettings, token_file: Path | None) -> None:
        """Run the EPP-protocol endpoint picker (honours the gate's subset hint)."""
        from epp_plugin.picker.server import PickerConfig, serve

        setup_logging(settings.log_level)
        serve_metrics(settings.metrics_port, settings.host)
        run_until_signal(lambda: serve(PickerConfig.model_validate(settings.model_dump())))
