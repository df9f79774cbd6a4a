"""Turn pydantic validation errors into located problems (``file:line: key: message``)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from geofed.located_yaml import KeyPath, LocatedDocument, format_key_path
from policies.errors import PolicyLoadError, Problem

ModelT = TypeVar("ModelT", bound=BaseModel)


def validate_document(model: type[ModelT], document: LocatedDocument, file: str) -> ModelT:
    """Validate ``document`` as ``model``; raise :class:`PolicyLoadError` with every error."""
    if not isinstance(document.data, dict):
        raise PolicyLoadError(
            [
                Problem(
                    file,
                    document.lines.line_of(()),
                    "(document)",
                    f"expected a mapping of keys at the top level, got {_type_name(document.data)}",
                )
            ]
        )
    try:
        return model.model_validate(document.data)
    except ValidationError as exc:
        raise PolicyLoadError(
            [_problem(model, error, document, file) for error in exc.errors()]
        ) from None


def _problem(
    model: type[BaseModel], error: ErrorDetails, document: LocatedDocument, file: str
) -> Problem:
    loc: KeyPath = tuple(error["loc"])
    kind = error["type"]
    message = error["msg"].removeprefix("Value error, ")
    if loc and loc[-1] == "[key]":
        loc = loc[:-1]
        message = f"invalid key {loc[-1]!r}: {message}" if loc else message
    elif kind == "missing":
        message = f"missing required key {loc[-1]!r}" if loc else "missing required key"
    elif kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        message = "unknown key" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
    else:
        # Sequences are tuples inside the models; in YAML they are lists.
        message = message.replace("valid tuple", "list")
        message = message.replace("Tuple should", "List should")
        if not isinstance(error.get("input"), dict | list):
            message += f" (got {error.get('input')!r})"
    return Problem(file, document.lines.line_of(loc), format_key_path(loc), message)


def _allowed_keys(model: type[BaseModel], path: KeyPath) -> list[str]:
    """Field names of the model found at ``path`` (list indices and dict keys skipped)."""
    annotation: Any = model
    for part in path:
        annotation = _step(annotation, part)
        if annotation is None:
            return []
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return [field.name for field in dataclasses.fields(annotation)]
    return []


def _step(annotation: Any, part: str | int) -> Any:
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(str(part))
        return field.annotation if field is not None else None
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is dict and len(args) == 2:
        return args[1]
    if origin in (tuple, list) and args:
        return args[0]
    return None


def _unwrap(annotation: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` down to the one type inside."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def _type_name(value: object) -> str:
    if value is None:
        return "nothing"
    return {str: "a string", list: "a list", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )
