"""Where a component's settings come from, and in which order: a YAML configuration file, the environment
(``LLMD_TIMESLICE_<SECTION>__<KEY>``) and the command line, layered over the schema's defaults
(:mod:`~llmd_timeslice.config.schema`); each problem reported as one line naming the key, the value and the source.
Decision record: docs/decisions/module-seams.md."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from llmd_timeslice import yaml_files
from llmd_timeslice.config.schema import (
    ENV_DELIMITER,
    ENV_PREFIX,
    SECTIONS,
    Flag,
    RuleError,
    TimesliceConfig,
    _file_ref,
    _FileOnlyConfig,
    render_refs,
)


class ConfigError(ValueError):
    """The configuration is not valid: ``errors`` holds one line per problem, each naming the field."""

    def __init__(self, errors: list[str], source: str = "") -> None:
        self.errors = errors
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("; ".join(prefix + e for e in errors))


def _known_keys(loc: tuple, root: type[BaseModel] | None = None) -> list[str]:
    """Field names valid at ``loc`` (the parent of an unknown key), for suggestions."""
    return list(getattr(yaml_files.model_at(root or TimesliceConfig, loc), "model_fields", {}))


def env_name(path: tuple) -> str:
    """The environment variable of a field: ``("gate", "max_hold_s")`` -> ``LLMD_TIMESLICE_GATE__MAX_HOLD_S``."""
    return ENV_PREFIX + ENV_DELIMITER.join(str(p) for p in path).upper()


@dataclass(frozen=True)
class Problem:
    """One invalid setting: ``loc`` the field's path (from the file's top level), ``message`` what is wrong."""

    loc: tuple
    message: str

    def line(self) -> str:
        """``dotted.field: message`` (``[from $VAR]`` when that variable is set)."""
        path = ".".join(str(p) for p in self.loc) or "(top level)"
        env = env_name(self.loc)
        return f"{path}: {self.message}" + (f" [from ${env}]" if self.loc and env in os.environ else "")


def problems(
    exc: ValidationError,
    prefix: tuple = (),
    ref: Callable[[str, str | None], str] | None = None,
    root: type[BaseModel] | None = None,
) -> list[Problem]:
    """One :class:`Problem` per error of ``exc``, raised validating ``root`` (at ``prefix`` in the file; default the
    whole file); a broken rule (:class:`RuleError`) is reported on its own field, the fields it names written by
    ``ref`` (default: as in a file)."""
    out = []
    for err in exc.errors(include_url=False):
        loc = (*prefix, *(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "json-or-python")))))
        kind, msg = err["type"], err["msg"]
        rule = (err.get("ctx") or {}).get("error")
        if isinstance(rule, RuleError):
            out.append(Problem((*loc, *rule.field.split(".")), render_refs(rule.message, ref or _file_ref)))
        elif kind == "extra_forbidden":
            parent, key = loc[:-1], str(loc[-1])
            close = difflib.get_close_matches(key, _known_keys(parent[len(prefix) :], root), n=1)
            out.append(
                Problem(loc, "unknown key" + (f" (did you mean {'.'.join([*map(str, parent), close[0]])}?)" if close else ""))
            )
        elif kind == "missing":
            out.append(Problem(loc, "required"))
        else:
            msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
            got = err.get("input")
            shown = "" if kind == "value_error" or isinstance(got, dict | list) else f" (got {got!r})"
            out.append(Problem(loc, f"{msg}{shown}"))
    return out


def error_lines(exc: ValidationError) -> list[str]:
    """One line per problem, each starting with the dotted field name."""
    return [p.line() for p in problems(exc)]


def read_config_file(path: str | os.PathLike) -> dict:
    """The mapping a configuration file holds (YAML or JSON), its top-level keys checked.

    Raises:
        ConfigError: unreadable, not UTF-8 text, not YAML, not a mapping, or a top-level key that is neither a section nor
            ``token_file`` (with a suggestion when one is close).
    """
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror or exc}"], source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([yaml_files.not_text(exc)], source) from None
    try:
        data = yaml_files.load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([yaml_files.error_text(exc)], source) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}"], source)
    return data


def load_config(path: str | os.PathLike | None = None, *, env: bool = True) -> TimesliceConfig:
    """Load ``path`` (YAML or JSON; None: environment and defaults only), environment on top.

    Raises:
        ConfigError: unreadable file, not YAML, not a mapping, or invalid fields (one line each).
    """
    source = str(path) if path is not None else "environment"
    data = read_config_file(path) if path is not None else {}
    try:
        return (TimesliceConfig if env else _FileOnlyConfig)(**data)
    except ValidationError as exc:
        raise ConfigError(error_lines(exc), source) from None
    except (ValueError, json.JSONDecodeError) as exc:  # e.g. an env variable that is not JSON for a list
        raise ConfigError([str(exc)], source) from None


# --------------------------------------------------------------------------- one component
@dataclass(frozen=True)
class CliField:
    """A settings field as an option of its component's command: ``path`` in the section
    (``("kubernetes", "namespace")``), ``option`` (``--namespace``), its pydantic field and :class:`Flag`."""

    path: tuple[str, ...]
    option: str
    field: Any  # pydantic FieldInfo
    flag: Flag

    @property
    def param(self) -> str:
        """The Python name of the option's parameter (``namespace``)."""
        return self.option.removeprefix("--").replace("-", "_")


def cli_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[CliField]:
    """Every field of a section, a nested section's fields flattened (each named by its own field name), as options.

    Raises:
        ValueError: two fields would have the same option (a schema mistake).
    """
    out: list[CliField] = []
    for key, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out.extend(cli_fields(field.annotation, (*prefix, key)))
            continue
        flag = next((m for m in field.metadata if isinstance(m, Flag)), Flag())
        out.append(CliField((*prefix, key), flag.name or "--" + key.replace("_", "-"), field, flag))
    seen: dict[str, tuple] = {}
    for f in out:
        if f.option in seen:
            raise ValueError(f"{model.__name__}: {'.'.join(seen[f.option])} and {'.'.join(f.path)} are both {f.option}")
        seen[f.option] = f.path
    return out


def _merge(*layers: Mapping) -> dict:
    """Nested mappings merged left to right (a later layer wins; mappings merge key by key, other values replace)."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), dict):
                out[key] = _merge(out[key], value)
            else:
                out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


def _has(data: Mapping, path: tuple) -> bool:
    for part in path:
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


def _nest(flat: Mapping[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _env_layer() -> dict:
    """``LLMD_TIMESLICE_*`` variables as a nested mapping (JSON decoded for lists and maps), as ``config check``
    reads them."""
    from pydantic_settings import EnvSettingsSource

    return EnvSettingsSource(TimesliceConfig)()


def component_settings(
    section: str, path: str | os.PathLike | None = None, flags: Mapping[tuple, Any] | None = None
) -> tuple[Any, Path | None]:
    """The settings one component runs with, and its token file.

    Layers, each over the one before: the section's defaults, its section in the file at ``path`` (YAML or JSON,
    as for ``config check``), ``LLMD_TIMESLICE_<SECTION>__<FIELD>`` variables, then ``flags`` (field path ->
    value, e.g. ``{("max_hold_s",): 30.0}``: the options given on the command line). The token file is the
    section's ``token_file``, else the top-level ``token_file`` (variable ``LLMD_TIMESLICE_TOKEN_FILE`` over the
    file).

    Raises:
        ConfigError: the file cannot be used, or settings are invalid; one line per problem, naming where the
            value came from (``--flag``, ``$VARIABLE`` or ``FILE: section.field``); a missing required value names
            all three.
    """
    model = SECTIONS[section]
    flags = dict(flags or {})
    file_data = read_config_file(path) if path is not None else {}
    unknown = [k for k in file_data if k not in TimesliceConfig.model_fields]
    if unknown:
        lines = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), list(TimesliceConfig.model_fields), n=1)
            lines.append(f"{key}: unknown key" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ConfigError(lines, str(path))
    file_section = file_data.get(section)
    file_section = {} if file_section is None else file_section
    if not isinstance(file_section, dict):
        raise ConfigError([f"{section}: expected a mapping of settings, got {type(file_section).__name__}"], str(path))
    try:
        env = _env_layer()
    except ValueError as exc:  # pydantic-settings' SettingsError: a variable that is not JSON for a list or a map
        raise ConfigError([str(exc)], "environment") from None
    env_section = env.get(section) or {}
    options = {f.path: f.option for f in cli_fields(model)}
    given = _nest(flags)

    def option_ref(field: str, value: str | None) -> str:
        opt = options.get(tuple(field.split(".")), field)
        return opt if value is None else f"{opt} {value}"

    try:
        settings = model.model_validate(_merge(file_section, env_section, given))
    except ValidationError as exc:
        lines = []
        for p in problems(exc, (section,), option_ref, model):
            field_path = p.loc[1:]
            at = next((field_path[:n] for n in range(len(field_path), 0, -1) if field_path[:n] in options), field_path)
            option = options.get(at)
            if option is not None and _has(given, at):
                lines.append(f"{option}: {p.message}")
            elif _has(env_section, at):
                lines.append(p.line())
            elif _has(file_section, at):
                lines.append(f"{path}: {p.line()}")
            elif option is not None and p.message == "required":
                where = f" or {'.'.join(p.loc)} in {path}" if path is not None else ""
                lines.append(f"{option}: required (or ${env_name(p.loc)}{where})")
            elif option is not None:  # a rule about a value nobody set
                lines.append(f"{option}: {p.message}")
            else:
                lines.append(p.line())
        raise ConfigError(lines) from None
    token_file, _ = _token_file_and_origin(settings, section, path, given, env, env_section, file_data, file_section)
    return settings, token_file


def _token_file_and_origin(settings, section, path, given, env, env_section, file_data, file_section):
    """The component's token file and where it was set (the option, a variable or ``FILE: key``; None: unset)."""
    token_file = getattr(settings, "token_file", None)
    if token_file is not None:
        if "token_file" in given:
            return token_file, "--token-file"
        if "token_file" in env_section:
            return token_file, f"${env_name((section, 'token_file'))}"
        return token_file, f"{path}: {section}.token_file"
    if env.get("token_file"):
        return Path(env["token_file"]), f"${env_name(('token_file',))}"
    if file_data.get("token_file"):
        return Path(file_data["token_file"]), f"{path}: token_file"
    return None, None


def component_token_origin(
    section: str, path: str | os.PathLike | None = None, flags: Mapping[tuple, Any] | None = None
) -> str | None:
    """Where the token file of :func:`component_settings` ``(section, path, flags)`` was set, for its errors:
    ``--token-file``, ``$LLMD_TIMESLICE_GATE__TOKEN_FILE``, ``FILE: gate.token_file``, ``$LLMD_TIMESLICE_TOKEN_FILE``
    or ``FILE: token_file`` (None: no token file set). Call it after :func:`component_settings` succeeded."""
    settings, _ = component_settings(section, path, flags)
    file_data = read_config_file(path) if path is not None else {}
    env = _env_layer()
    file_section = file_data.get(section) or {}
    return _token_file_and_origin(
        settings, section, path, _nest(dict(flags or {})), env, env.get(section) or {}, file_data, file_section
    )[1]
