"""The one place where command-line flags, `PAGEDSERVE_*` environment variables and a YAML
config file meet. Precedence, highest first: flag, environment variable, config file, default.

Every setting is a field of a config section; its flag is the field name in kebab case
(`max_num_seqs` -> `--max-num-seqs`), its environment variable the name in upper case behind
`PAGEDSERVE_` (`PAGEDSERVE_MAX_NUM_SEQS`), its config-file key either spelling.
"""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from config.engine_config import ENGINE_SECTIONS, ConfigError, EngineConfig, build_sections, flag
from config.media_config import vllm_env_settings
from config.server_config import ServeConfig, ServerConfig

ENV_PREFIX = "PAGEDSERVE_"
SERVE_SECTIONS: dict[str, type[BaseModel]] = {**ENGINE_SECTIONS, "server": ServerConfig}


def _fields(sections: Mapping[str, type[BaseModel]]) -> dict[str, FieldInfo]:
    return {name: info for model in sections.values() for name, info in model.model_fields.items()}


def _base_type(annotation: object) -> object:
    """The type without its `| None`."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _is_list(annotation: object) -> bool:
    return get_origin(_base_type(annotation)) is list


def add_flags(
    parser: argparse.ArgumentParser,
    sections: Mapping[str, type[BaseModel]],
    skip: tuple[str, ...] = (),
) -> None:
    """One flag per field, typed and documented from the field. Flags default to 'absent'
    (SUPPRESS) so that only what the user typed overrides the environment and the file."""
    for name, info in _fields(sections).items():
        if name in skip:
            continue
        base = _base_type(info.annotation)
        # argparse takes different keyword arguments for each kind of option: Any, not object.
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": name}
        default = info.default
        shown = (
            "none"
            if default is None
            else ",".join(default)
            if isinstance(default, list)
            else default
        )
        # A computed default is described in the field's own text; a secret's is not shown.
        quiet = info.default_factory is not None or info.repr is False or default is None
        kwargs["help"] = (
            f"{info.description} [env {ENV_PREFIX}{name.upper()}"
            + ("" if quiet else f"; default: {shown}")
            + "]"
        )
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(base) is Literal:
            kwargs["choices"] = list(get_args(base))
        elif get_origin(base) is list:
            kwargs["nargs"] = "+"
        elif base in (int, float):
            kwargs["type"] = base
        parser.add_argument(flag(name), **kwargs)


def from_env(env: Mapping[str, str], sections: Mapping[str, type[BaseModel]]) -> dict[str, object]:
    """Settings from `PAGEDSERVE_<NAME>` variables; a list is comma-separated or a JSON array.
    Other `PAGEDSERVE_*` variables (PAGEDSERVE_CACHE_DIR) belong to someone else and are left alone."""
    settings: dict[str, object] = {}
    for name, info in _fields(sections).items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if _is_list(info.annotation):
            settings[name] = (
                json.loads(raw)
                if raw.lstrip().startswith("[")
                else [p.strip() for p in raw.split(",") if p.strip()]
            )
        else:
            settings[name] = raw  # pydantic turns "64" into 64 and "false" into False
    return settings


def from_file(path: Path, sections: Mapping[str, type[BaseModel]]) -> dict[str, object]:
    """Settings from a YAML mapping whose keys are flag names, with dashes or underscores."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: expected a mapping of settings, got {type(data).__name__}"
        )
    known = _fields(sections)
    settings: dict[str, object] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"--config {path}: unknown setting {key!r}; known settings: {', '.join(sorted(known))}"
            )
        settings[name] = value
    return settings


def merge(
    cli: Mapping[str, object],
    env: Mapping[str, str],
    config_file: Path | None,
    sections: Mapping[str, type[BaseModel]],
) -> dict[str, Any]:
    """Flat settings: the file's, overridden by the environment's, overridden by the flags'
    (values of every type: the config models validate them)."""
    settings = from_file(config_file, sections) if config_file else {}
    # vLLM's variables for the same settings (VLLM_IMAGE_FETCH_TIMEOUT, ...) count as the
    # environment's, below ours.
    known = _fields(sections)
    settings.update({k: v for k, v in vllm_env_settings(env).items() if k in known})
    settings.update(from_env(env, sections))
    settings.update(cli)
    return settings


def serve_config(
    cli: Mapping[str, object], env: Mapping[str, str], config_file: Path | None = None
) -> ServeConfig:
    built = build_sections(SERVE_SECTIONS, merge(cli, env, config_file, SERVE_SECTIONS))
    server = built.pop("server")
    assert isinstance(server, ServerConfig)
    return ServeConfig(engine=EngineConfig(**built), server=server)
