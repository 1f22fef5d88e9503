"""``llmd-timeslice config``: check a configuration file or a stack file (one clear line per problem), print the
configuration's JSON schema, or its Markdown reference (docs/configuration.md). Added to the main command by
:mod:`llmd_timeslice.cli`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

config_app = typer.Typer(
    help="Check a configuration file or a stack file, print the configuration's JSON schema or its reference.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@config_app.command("check", short_help="Validate a configuration file or a stack file.")
def config_check(
    file: Annotated[
        Path,
        typer.Argument(
            metavar="FILE",
            help="YAML (or JSON) configuration file (LLMD_TIMESLICE_* variables apply "
            "on top), or a stack file of `up` (recognised by its `stack` or "
            "`engines` key).",
        ),
    ],
    env: Annotated[bool, typer.Option(help="Apply LLMD_TIMESLICE_<SECTION>__<FIELD> environment variables.")] = True,
) -> None:
    """Validate FILE: prints OK and a summary, or one line per error (exit 2).

    A stack file is checked as `up` checks it before it starts anything (its nodes, host and token file
    included), without starting anything; ports that are in use now are listed as notes (`up` would refuse them)."""
    from llmd_timeslice.config import ConfigError, load_config, summary_lines

    data = _parsed(file)
    if _check_stack_file(file, data) or _check_inventory(file, data):
        return
    try:
        cfg = load_config(file, env=env)
    except ConfigError as exc:
        for line in exc.errors:
            typer.echo(f"{file}: {line}", err=True)
        if _no_known_top_level_key(data) and not any("did you mean" in line for line in exc.errors):
            typer.echo(f"{file}: {_FILE_KINDS}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"OK {file}: {', '.join(cfg.configured()) or 'no component'} configured")
    for line in summary_lines(cfg):
        typer.echo(f"  {line}")


_UNREADABLE = object()

_FILE_KINDS = (
    "config check reads a component configuration (top-level gate, picker, orchestrator, sidecar), a stack file of "
    "`up` (stack, pools, groups, engines, ...) or a static inventory (groups)"
)


def _no_known_top_level_key(data: object) -> bool:
    """True when parsed YAML ``data`` is of no kind ``config check`` knows: not a mapping, or a mapping without one
    top-level key of a component configuration (checked by the caller's loader, which names the closest key)."""
    from llmd_timeslice.config import SECTIONS

    if data is _UNREADABLE or data is None:
        return False
    return not isinstance(data, dict) or not any(k in (*SECTIONS, "token_file") for k in data)


def _parsed(file: Path) -> object:
    """FILE's parsed YAML, or ``_UNREADABLE`` when it cannot be read or parsed (the component-config path reports
    it, as for a configuration file)."""
    import yaml

    from llmd_timeslice import yaml_files

    try:
        return yaml_files.load(file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return _UNREADABLE


def _check_stack_file(file: Path, data: object) -> bool:
    """``config check`` on a stack file (``data``: FILE parsed, :func:`_parsed`): True when FILE is one (and was
    checked); exits 2 on problems. An empty file is refused as ``up -f`` refuses it (no kind of file the project
    reads is empty)."""
    from llmd_timeslice.local.stack_file import EMPTY_FILE, StackError, load_stack_file, looks_like_stack_file

    if data is None or data == {}:
        typer.echo(f"{file}: {EMPTY_FILE}", err=True)
        raise typer.Exit(2)
    if not looks_like_stack_file(data):
        return False
    try:
        sf = load_stack_file(file)
    except StackError as exc:
        for line in exc.errors:
            typer.echo(f"{file}: {line}", err=True)
        raise typer.Exit(2) from None
    from llmd_timeslice.local.preflight import start_check
    from llmd_timeslice.local.up import Stack

    base = file.resolve().parent
    check = start_check(sf, base)  # what `up` refuses before it starts anything
    for line in check.errors:
        typer.echo(f"{file}: {line}", err=True)
    if check.errors:
        raise typer.Exit(2)
    counts = f"{_count(len(sf.engines), 'engine')}, {_count(len(sf.groups), 'group')}, {_count(len(sf.pools), 'pool')}"
    typer.echo(f"OK {file}: stack file ({counts})")
    for line in sf.summary_lines(base):
        typer.echo(f"  {line}")
    for line in check.notes:
        typer.echo(f"  note: {line}")
    for line in Stack(sf, base).port_problems():
        typer.echo(f"  note: {line}; `up` would refuse it now")
    return True


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _check_inventory(file: Path, data: object) -> bool:
    """``config check`` on a static inventory (``orchestrator --inventory``, the file ``up`` and the demo write;
    ``data``: FILE parsed): True when FILE is one (and was checked); exits 2 on problems, one line each."""
    from llmd_timeslice.discovery.static import InventoryError, load_inventory, looks_like_inventory

    if not looks_like_inventory(data):
        return False
    try:
        inv = load_inventory(file)
    except InventoryError as exc:
        for line in exc.errors:
            typer.echo(f"{file}: {line}", err=True)
        raise typer.Exit(2) from None
    samplers = sum(len(g.samplers) for g in inv.groups)
    typer.echo(f"OK {file}: inventory ({_count(len(inv.groups), 'group')}, {_count(samplers, 'sampler')})")
    for g in inv.groups:
        typer.echo(
            f"  {g.group_id}: sleep_level {g.sleep_level} ({g.sleep_level_policy}), drain_timeout {g.drain_timeout_s:g} s, "
            f"{', '.join(f'{s.job_id}@{s.address} (pool {s.pool})' for s in g.samplers) or 'no samplers'}"
        )
    return True


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON schema of the configuration file."""

    from llmd_timeslice.config import json_schema

    typer.echo(json.dumps(json_schema(), indent=2))


@config_app.command("reference")
def config_reference() -> None:
    """Print the Markdown reference (docs/configuration.md)."""
    from llmd_timeslice.config import reference_markdown

    typer.echo(reference_markdown(), nl=False)
