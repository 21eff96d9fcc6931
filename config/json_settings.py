"""Settings given as one JSON object (a flag such as --kv-events-config or
--speculative-config): parsed into a pydantic model, every problem named by its key."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


def parse_json_settings(value: object, model: type[Model]) -> Model | None:
    """The setting from a JSON string (the flag, the environment), a mapping (a config file,
    `LLM(...)`) or a built model; a ValueError that names each bad key otherwise."""
    if value is None or isinstance(value, model):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object of settings, got {type(value).__name__}")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            if not key:  # a rule across keys: its message names them
                problems.append(str(err["msg"]).removeprefix("Value error, "))
            elif err["type"] == "extra_forbidden":
                known = ", ".join(model.model_fields)
                problems.append(f"unknown key {key!r} (known keys: {known})")
            else:
                problems.append(f"key {key!r}: {err['msg']} (got {err.get('input')!r})")
        raise ValueError("; ".join(problems)) from None
