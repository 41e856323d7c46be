"""PATCH bodies for the settings routes: every field of the route's ``PUT`` body, optional, merged into the current
values (a field left out keeps its value) and validated as the ``PUT`` body, so a bad value is the same 422 naming
the field (``invalid_request``: "temperature: Input should be less than or equal to 2").

NOTE: read, merge, write: two admins patching different fields of one setting at the same instant may lose one
change (the last write wins, as with ``PUT``); the audit trail shows both.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)


def partial_model(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` with every field optional (default: left out), for the OpenAPI schema and a first check; the
    constraints are checked on the merge (``merged``), against ``model`` itself."""
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        annotation: Any = info.annotation
        fields[name] = (annotation | None, FieldInfo(default=None, description=info.description))
    return create_model(f"{model.__name__}Patch", __config__=ConfigDict(extra="forbid"), **fields)


def merged(current: BaseModel, patch: BaseModel, model: type[M]) -> M:
    """``current`` (its fields that ``model`` has) with the fields ``patch`` sets, as a valid ``model``; else the
    422 a ``PUT`` of the same values gets."""
    values = current.model_dump(include=set(model.model_fields)) | patch.model_dump(exclude_unset=True)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
