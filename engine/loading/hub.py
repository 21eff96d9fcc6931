"""Models and tokenizers named by a Hugging Face Hub repo id (`org/name`): resolved to a snapshot
folder of the Hugging Face hub cache (`models--org--name/snapshots/<commit>`), downloading into it
only the files pagedserve reads. `HF_HUB_OFFLINE=1`, `HF_ENDPOINT` and `HF_TOKEN` work as they do
for transformers, because huggingface_hub itself reads them.

Every failure becomes a `ModelLoadError` that says what to do about it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import HFValidationError, validate_repo_id

from config import ModelConfig
from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

# The one weight index the loader reads (engine.loading.model_loader.iter_safetensors).
WEIGHT_INDEX = "model.safetensors.index.json"
# Config and tokenizer: small files, fetched first so that a model we cannot serve is refused
# before gigabytes of weights are downloaded. Exact names match top-level files only.
METADATA_FILES = [
    "config.json",
    "generation_config.json",
    WEIGHT_INDEX,
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
# Top-level files only: subfolders (`original/`, `onnx/`) hold the same weights in other layouts.
SUBFOLDERS = ["*/*"]
# The network libraries huggingface_hub has used across versions; their errors mean "the
# download broke", whatever the version.
_NETWORK_MODULES = {"httpx", "httpx2", "requests", "urllib3", "ssl", "socket"}

ConfigCheck = Callable[[Path], None]


def is_repo_id(name: str) -> bool:
    """`org/name` as the Hub spells repo ids. A bare `name` is not taken for one: it is far more
    often a mistyped local folder than a legacy un-namespaced repo."""
    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _cache_dir(download_dir: Path | None) -> Path:
    return Path(download_dir or constants.HF_HUB_CACHE).expanduser()


def download_model(
    repo_id: str,
    revision: str | None,
    download_dir: Path | None,
    check: ConfigCheck | None = None,
) -> Path:
    """The snapshot folder of `repo_id` at `revision` with its config, tokenizer and safetensors
    weights. `check` is called on the folder once config and tokenizer are in, before the
    weights are fetched: it raises `ModelLoadError` for a model the engine cannot serve."""
    folder = _snapshot(repo_id, revision, download_dir, METADATA_FILES)
    commit = folder.name  # snapshots/<commit>: later look-ups are pinned to it
    refuse_remote_code(repo_id, folder)
    if check is not None:
        check(folder)
    index = folder / WEIGHT_INDEX
    if index.is_file():
        # A sharded checkpoint: exactly its shards (a repo may also ship a consolidated copy).
        shards = index_shards(index)
        folder = _snapshot(repo_id, commit, download_dir, shards)
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise ModelLoadError(
                f"model {repo_id} (commit {commit}): {WEIGHT_INDEX} names shards that are not in "
                f"the repo or the cache: {', '.join(missing[:3])}"
            )
    else:
        folder = _snapshot(repo_id, commit, download_dir, ["*.safetensors"], SUBFOLDERS)
        if not any(folder.glob("*.safetensors")):
            raise ModelLoadError(
                f"model {repo_id} (commit {commit}) has no safetensors weights (*.safetensors); "
                "pagedserve loads only safetensors, not .bin/.pt pickles or .gguf/.onnx files: "
                "choose a repo or --revision that has safetensors weights"
            )
    log.info("model %s at %s: %s", repo_id, revision or constants.DEFAULT_REVISION, folder)
    return folder


def tokenizer_path(config: ModelConfig) -> Path:
    """Where `--tokenizer` points: an existing folder as it is, else a repo id's snapshot of its
    tokenizer files. It shares `--revision` only when it names the model's own repo."""
    assert config.tokenizer is not None
    path = Path(config.tokenizer).expanduser()
    if path.is_dir() or not is_repo_id(config.tokenizer):
        return path  # the tokenizer loader reports a missing folder
    revision = config.revision if config.tokenizer == config.model else None
    return _snapshot(config.tokenizer, revision, config.download_dir, METADATA_FILES)


def refuse_remote_code(repo_id: str, folder: Path) -> None:
    """pagedserve never runs code from a model repo. A model needs such code when transformers
    does not know its model_type or architecture: transformers would then run the repo's code
    (`auto_map` in config.json) with trust_remote_code, or cannot read it at all."""
    config = _read_config(repo_id, folder)
    unknown = _unknown_to_transformers(config)
    if not unknown:
        return  # an auto_map next to a known architecture is not used, as in transformers
    import transformers

    why = (
        "its config.json maps it to code in the repo (auto_map)"
        if config.get("auto_map")
        else "it is not one transformers knows"
    )
    raise ModelLoadError(
        f"model {repo_id} needs remote code: its architecture {unknown} is not in transformers "
        f"{transformers.__version__} and {why}. pagedserve does not run remote code "
        "(trust_remote_code), so it cannot serve this model"
    )


def _read_config(repo_id: str, folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"model {repo_id} has no config.json (commit {folder.name}): it is not a transformers model"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return config


def _unknown_to_transformers(config: dict[str, Any]) -> str:
    """The architecture (or model_type) transformers has no code for, or ''."""
    import transformers
    from transformers import CONFIG_MAPPING

    known = set(dir(transformers))  # the lazy module lists every class without importing it
    for name in config.get("architectures") or []:
        if name not in known:
            return str(name)
    model_type = config.get("model_type")
    if model_type is not None and model_type not in CONFIG_MAPPING:
        return f"model_type {model_type!r}"
    return ""


def safetensors_files(path: Path) -> list[str]:
    """The safetensors files of a local checkpoint: the shards its weight index names, or every
    *.safetensors in the folder, sorted."""
    index = path / WEIGHT_INDEX
    files = (
        index_shards(index)
        if index.is_file()
        else sorted(p.name for p in path.glob("*.safetensors"))
    )
    if not files:
        raise ModelLoadError(f"no safetensors weights in {path}")
    return files


def index_shards(index: Path) -> list[str]:
    """The shard files a sharded checkpoint's weight index names, sorted, each once."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read the weight index {index}: {exc}") from exc


def _snapshot(
    repo_id: str,
    revision: str | None,
    download_dir: Path | None,
    allow: list[str],
    ignore: list[str] | None = None,
) -> Path:
    """huggingface_hub's snapshot of the files matching `allow`, from the cache, downloading
    what is missing unless offline; its errors turned into what the user can do about them."""
    cache = _cache_dir(download_dir)
    at = f" (revision {revision!r})" if revision else ""
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=download_dir,
                allow_patterns=allow,
                ignore_patterns=ignore,
            )
        )
    except GatedRepoError as exc:  # before RepositoryNotFoundError: it is one
        raise ModelLoadError(
            f"model {repo_id} is gated on the Hugging Face Hub: accept its licence at "
            f"{constants.ENDPOINT}/{repo_id} while logged in, then set HF_TOKEN to an access "
            "token of that account"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(
            f"{repo_id!r} is neither a local folder nor a model repo on the Hugging Face Hub "
            f"({constants.ENDPOINT}): check the name; for a private repo set HF_TOKEN"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelLoadError(
            f"model {repo_id} has no revision {revision!r} on the Hugging Face Hub: give an existing "
            "branch, tag or commit with --revision"
        ) from exc
    except LocalEntryNotFoundError as exc:  # the Hub was not asked, or did not answer
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(
                f"model {repo_id}{at} is not (completely) in the Hugging Face cache at {cache} and "
                "HF_HUB_OFFLINE is set: download it once online (unset HF_HUB_OFFLINE), or point "
                "--download-dir at a cache that has it"
            ) from exc
        raise ModelLoadError(
            f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} to download model "
            f"{repo_id}{at}, and it is not (completely) in the cache at {cache}: check the network "
            "connection (and HF_ENDPOINT, proxy settings), or download it where there is one"
        ) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        raise ModelLoadError(
            f"the Hugging Face Hub answered {status} for model {repo_id}{at}: "
            f"{str(exc).splitlines()[0]}"
        ) from exc
    except OSError as exc:  # the cache folder: permissions, disk full
        raise ModelLoadError(f"cannot download model {repo_id} into {cache}: {exc}") from exc
    except Exception as exc:
        # A broken connection mid-download surfaces as the network library's own error.
        if type(exc).__module__.split(".")[0] in _NETWORK_MODULES:
            raise ModelLoadError(
                f"downloading model {repo_id}{at} from {constants.ENDPOINT} failed: "
                f"{type(exc).__name__}: {exc}; run again to resume"
            ) from exc
        raise
