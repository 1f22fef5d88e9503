"""A component's command built from its settings model: one option per field, ``--config FILE``, one resolution.

``llmd-timeslice gate|picker|orchestrator|sidecar`` each take their options from the section model in
:mod:`llmd_timeslice.config` (:func:`llmd_timeslice.config.cli_fields`: ``max_hold_s`` is ``--max-hold-s``,
the field's description is the help, its type and constraints check the value), so a flag, an environment
variable and a key of the configuration file cannot drift apart. The command hands the options given on its
command line to :func:`llmd_timeslice.config.component_settings`, which layers them over the environment, the
file and the defaults and validates the result: the component runs with exactly what ``config check`` checks,
plus its flags.
"""

from __future__ import annotations

import enum
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from llmd_timeslice.config import (
    SECTIONS,
    CliField,
    ConfigError,
    Flag,
    Seconds,
    cli_fields,
    component_settings,
    component_token_origin,
)

Run = Callable[[Any, Path | None], None]
"""What a component command runs: ``run(settings, token_file)`` (the validated section model, its token file)."""


def _parts(annotation: Any) -> tuple[Any, list[Any]]:
    """``(base type, metadata)`` of an annotation, ``X | None`` and ``Annotated`` unwrapped."""
    meta: list[Any] = []
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation, *more = typing.get_args(annotation)
            meta.extend(more)
        elif origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation, meta
            annotation = args[0]
        else:
            return annotation, meta


def _metavar(f: CliField) -> str | None:
    if f.flag.metavar:
        return f.flag.metavar
    base, meta = _parts(f.field.annotation)
    meta = [*f.field.metadata, *meta]
    if typing.get_origin(base) is list:
        base, more = _parts(typing.get_args(base)[0])
        meta.extend(more)
    if any(m is Seconds for m in meta):
        return "SECONDS"
    named = next((m.metavar for m in meta if isinstance(m, Flag) and m.metavar), None)
    if named:
        return named
    if typing.get_origin(base) is Literal:
        return "[" + "|".join(str(a) for a in typing.get_args(base)) + "]"
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return "[" + "|".join(str(m.value) for m in base) + "]"
    return {int: "INTEGER", float: "NUMBER", str: "TEXT", Path: "FILE"}.get(base)


def _checker(annotation: Any) -> Callable[[str], Any]:
    """Parse and check one command-line value as the field's type does (constraints included); a problem is
    pydantic's one-line message (typer names the option)."""
    adapter: TypeAdapter = TypeAdapter(annotation)

    def check(value: Any) -> Any:
        try:
            return adapter.validate_python(value)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            raise PydanticCustomError("invalid_option", err["msg"].removeprefix("Value error, ")) from None

    return check


def _option(f: CliField) -> tuple[Any, Any]:
    """``(annotation with its typer.Option, default)`` of one field's option."""
    field = f.field
    help_text = (f.flag.help or field.description or "").replace("`", "")
    if len(f.path) > 1:
        help_text = f"{f.path[0]}: {help_text}"
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        default = None
    base, _ = _parts(field.annotation)
    if base is bool:
        name = f.option.removeprefix("--")
        return Annotated[bool, typer.Option(f"--{name}/--no-{name}", help=help_text)], default
    metavar = _metavar(f)
    if typing.get_origin(base) is dict:
        if f.flag.item is None:
            raise TypeError(f"{'.'.join(f.path)}: a map field needs Flag(item=...) to be an option")
        return (
            Annotated[
                list[str],
                typer.Option(f.option, parser=_item_parser(f.flag.item), show_default=False, help=help_text, metavar=metavar),
            ],
            None,
        )
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        option = typer.Option(f.option, parser=_checker(item), help=help_text, metavar=metavar)
        return Annotated[list[str], option], default or None
    full = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return Annotated[str, typer.Option(f.option, parser=_checker(full), help=help_text, metavar=metavar)], default


def _item_parser(item: Callable[[str], tuple[str, Any]]) -> Callable[[str], tuple[str, Any]]:
    def parse(value: Any) -> tuple[str, Any]:
        if isinstance(value, tuple):
            return value
        try:
            return item(value)
        except ValueError as exc:
            raise PydanticCustomError("invalid_option", str(exc)) from None

    return parse


def _flag_value(f: CliField, value: Any) -> Any:
    """The field value of what the option collected (a map from its ``KEY=VALUE`` items)."""
    base, _ = _parts(f.field.annotation)
    if typing.get_origin(base) is dict:
        many = typing.get_origin(_parts(typing.get_args(base)[1])[0]) is list
        out: dict[str, Any] = {}
        for key, item in value or ():
            if many:
                out.setdefault(key, []).append(item)
            else:
                out[key] = item
        return out
    if typing.get_origin(base) is list:
        return list(value or ())
    return value.value if isinstance(value, enum.Enum) else value


def settings_command(app: typer.Typer, section: str, *, short_help: str) -> Callable[[Run], Run]:
    """Register ``run`` as the command ``section`` of ``app``: options from ``SECTIONS[section]``, ``--config``.

    The command validates its settings (:func:`~llmd_timeslice.config.component_settings`); on a problem it prints
    one line per problem, naming the option, variable or file key, and exits with code 2 before ``run``. Its help
    is ``run``'s docstring.
    """
    model = SECTIONS[section]
    fields = cli_fields(model)

    def decorate(run: Run) -> Run:
        def command(ctx: typer.Context, **kwargs: Any) -> None:
            given = {
                f.path: _flag_value(f, kwargs[f.param])
                for f in fields
                if getattr(ctx.get_parameter_source(f.param), "name", None) == "COMMANDLINE"
            }
            try:
                settings, token_file = component_settings(section, kwargs["config"], given)
            except ConfigError as exc:
                for line in exc.errors:
                    typer.echo(f"llmd-timeslice {section}: {f'{exc.source}: ' if exc.source else ''}{line}", err=True)
                raise typer.Exit(2) from None
            if token_file is not None:  # a token file that cannot be read: one line naming its setting, nothing run
                from llmd_timeslice.auth import load_token

                try:
                    load_token(token_file, component_token_origin(section, kwargs["config"], given) or "--token-file")
                except (OSError, ValueError) as exc:
                    typer.echo(f"llmd-timeslice {section}: {exc}", err=True)
                    raise typer.Exit(2) from None
            run(settings, token_file)

        params = [
            inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context),
            inspect.Parameter(
                "config",
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    Path | None,
                    typer.Option(
                        "--config",
                        metavar="FILE",
                        dir_okay=False,
                        help=(
                            f"Configuration file (YAML or JSON): its {section} section and top-level token_file apply, "
                            f"under LLMD_TIMESLICE_{section.upper()}__* variables and the options given here."
                        ),
                    ),
                ],
            ),
        ]
        for f in fields:
            annotation, default = _option(f)
            params.append(inspect.Parameter(f.param, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.__doc__ = run.__doc__
        command.__name__ = command.__qualname__ = section
        epilog = (
            f"Every option is also a key of the {section} section of --config FILE and a variable "
            f"LLMD_TIMESLICE_{section.upper()}__<KEY> (docs/configuration.md names each; lists and maps as "
            "JSON). An option given here wins over the variable, the variable over the file. Durations: "
            "seconds, or with a unit: 500ms, 30s, 10m, 1h."
        )
        app.command(section, short_help=short_help, epilog=epilog)(command)
        return run

    return decorate
