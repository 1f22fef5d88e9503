"""Reading the project's YAML (and JSON) files, and saying in one line what is wrong with one.

Every file the project reads (configuration ``--config``, stack file, static inventory, job tokens, the guide's
``settings.yaml``, the manifests given to ``k8s modelserver``) goes through :func:`load` / :func:`load_all`: PyYAML's
safe loader (YAML 1.1 types, no Python objects) that also refuses a key given twice in one mapping, which PyYAML
itself accepts silently (the last value wins: ``max_hold_s: 5`` then ``max_hold_s: 120`` would run with 120).
A merge key (``<<: *anchor``) is not a duplicate: the keys written next to it override the merged ones, as YAML's
merge type says (https://yaml.org/type/merge.html).

:func:`validation_lines` turns a pydantic ``ValidationError`` of a file's model into one line per problem
(``groups[0].sleep_levle: unknown key (did you mean groups[0].sleep_level?)``), for every file model alike.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:  # pydantic is imported where a model is validated: manifests/generate.py reads files without it
    from pydantic import BaseModel, ValidationError

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of the file has the same key twice; ``str()`` is one line naming the key and both lines
    (1-based, as an editor shows them)."""

    def __init__(self, key: Any, first_line: int, second_line: int) -> None:
        self.key, self.first_line, self.second_line = key, first_line, second_line
        super().__init__(f"duplicate key {key!r} (line {first_line} and line {second_line}); keep one")

    def __str__(self) -> str:
        return self.args[0]


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises :class:`DuplicateKeyError` for a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                if first is not None:
                    raise DuplicateKeyError(key, first, line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """The one document of ``text`` (None when empty).

    Raises:
        DuplicateKeyError: a key twice in one mapping.
        yaml.YAMLError: not valid YAML (a :class:`DuplicateKeyError` is one too).
    """
    return yaml.load(text, Loader=StrictLoader)


def load_all(text: str) -> Iterator[Any]:
    """Each document of a multi-document ``text`` (``---`` separated), as :func:`load` reads one."""
    return yaml.load_all(text, Loader=StrictLoader)


def error_text(exc: yaml.YAMLError) -> str:
    """One line for a YAML problem: a duplicate key as is, a syntax error as ``not valid YAML at line L, column C:
    <problem> (<while parsing what> at line L, column C)``, from PyYAML's marks (1-based here, 0-based there); an
    error without a mark as PyYAML words it, on one line."""
    if isinstance(exc, DuplicateKeyError):
        return str(exc)
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        text = f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
        if exc.context:
            at = exc.context_mark
            text += f" ({exc.context}" + (f" at line {at.line + 1}, column {at.column + 1})" if at else ")")
        return text
    return "not valid YAML: " + " ".join(str(exc).split())


def not_text(exc: UnicodeDecodeError) -> str:
    """One line for a file that is not UTF-8 text (a binary file, another encoding): the first bad byte and its
    offset (bytes from the start)."""
    return f"not a text file (UTF-8): byte {exc.object[exc.start]:#04x} at offset {exc.start}"


# ------------------------------------------------------------------ validation errors of a file's model
def model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model whose fields are valid at ``loc`` (field names from ``root``; list indices and map keys of a
    ``dict[str, Model]`` skipped), or None past a value that is not a model."""
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = _inner_model(field.annotation)
    return model


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    """The model inside ``annotation`` (``Model``, ``Model | None``, ``list[Model]``, ``Annotated[...]``)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def loc_text(loc: tuple) -> str:
    """``("groups", 0, "sleep_level")`` -> ``groups[0].sleep_level`` (pydantic's validator steps left out)."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts[-1:] = [f"{parts[-1]}[{p}]"] if parts else [f"[{p}]"]
        elif not str(p).startswith("function-"):
            parts.append(str(p))
    return ".".join(parts) or "(top level)"


def _clean(loc: tuple) -> tuple:
    return tuple(p for p in loc if not str(p).startswith("function-"))


def _closest_key(err: Mapping[str, Any], root: type[BaseModel]) -> tuple[str | None, list[str]]:
    """For an ``extra_forbidden`` error of ``root``: (the location of the valid key closest to the unknown one, e.g.
    ``stack.max_hold_s``, or None) and the keys valid there."""
    loc = _clean(err["loc"])
    parent, key = loc[:-1], str(loc[-1])
    model = model_at(root, parent)
    known = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, known, n=1)
    return (loc_text((*parent, close[0])) if close else None), known


def _unknown_key_text(close: str | None, known: list[str]) -> str:
    """``unknown key (did you mean stack.max_hold_s?)`` (``close``, from :func:`_closest_key`), or the keys valid
    there (``known``) when none is close."""
    if close is not None:
        return f"unknown key (did you mean {close}?)"
    return f"unknown key (known here: {', '.join(known)})" if known else "unknown key"


def validation_lines(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per error of ``exc`` (raised validating ``root``): ``where: what``, no URL, no input dump. A required
    key that is missing because it is misspelled gets one line, the misspelling's ``did you mean``, not a second
    ``required`` line before it (``enignes:`` for ``engines:``)."""
    errors = exc.errors(include_url=False)
    closest = {i: _closest_key(e, root) for i, e in enumerate(errors) if e["type"] == "extra_forbidden"}
    suggested = {close for close, _ in closest.values()}
    lines = []
    for i, e in enumerate(errors):
        where = loc_text(e["loc"])
        if i in closest:
            msg = _unknown_key_text(*closest[i])
        elif e["type"] == "missing":
            if where in suggested:
                continue
            msg = "required"
        else:
            msg = e["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        lines.append(f"{where}: {msg}")
    return lines
