"""Reading a PEFT LoRA checkpoint: `adapter_config.json` (rank, alpha, rsLoRA, targets) and
`adapter_model.safetensors` (each target module's A and B). Everything that would make the
adapter wrong or unusable is refused here, before it comes near a slot: a missing folder, a
rank above the slots' rank, a config this engine does not apply (DoRA, per-module ranks,
trained biases or whole modules), tensors that do not pair up or do not fit their rank, an
alpha or a weight that is not a finite number. The files are read as engine/lora/files.py
reads them: regular files only, each within a cap, so that no path can hang the reader."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from engine.errors import InvalidRequestError
from engine.lora.files import FileRefused, FileTooLarge, read_regular_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: the decoder layers' attention and MLP linears.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT writes a few hundred bytes of settings; a megabyte is any real config with room to spare.
MAX_CONFIG_BYTES = 1 << 20


class LoRALoadError(InvalidRequestError):
    """An adapter that cannot be served: a 400 when loaded at run time, a start-up error when
    named on the command line. `param`: `lora_path` where the request names the folder (a
    load), `model` where it names the adapter (a completion)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message, param=param)


@dataclass(frozen=True)
class LoRACheckpoint:
    rank: int
    scaling: float  # alpha / rank, or alpha / sqrt(rank) under rsLoRA
    # checkpoint module name ("model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r])
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    base_model_name: str | None


def _refuse(path: Path, why: str) -> LoRALoadError:
    return LoRALoadError(f"LoRA adapter {str(path)!r}: {why}")


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(read_regular_file(path / CONFIG_FILE, MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise _refuse(path, f"no {CONFIG_FILE} (not a PEFT adapter folder)") from None
    except FileRefused as exc:
        raise _refuse(path, str(exc)) from None
    except (OSError, ValueError) as exc:
        raise _refuse(path, f"cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(path: Path, config: dict, max_rank: int) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {config.get('peft_type')!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    # bool is an int in Python: `"r": true` must not read as rank 1.
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse(path, f"rank r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _refuse(path, f"lora_alpha must be a number, got {alpha!r}")
    # Python's json reads NaN and Infinity, and an integer past a float's range: each would
    # scale every update into NaN or inf, so the adapter's tokens would be garbage.
    alpha = _finite_alpha(path, alpha)
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise _refuse(path, f"use_rslora must be true or false, got {rslora!r}")
    if rank > max_rank:
        raise _refuse(path, f"rank {rank} is above --max-lora-rank {max_rank}")
    # Settings that change what the update is; applying the adapter without them would give
    # other tokens than the trained model, so they are refused rather than ignored.
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") not in (None, "none"),
    }
    bad = [name for name, used in unsupported.items() if used]
    if bad:
        raise _refuse(path, f"{', '.join(bad)} not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # a regex in PEFT: the tensors say what it matched
        targets = []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _refuse(
            path, f"target_modules must be a string or a list of strings, got {targets!r}"
        )
    unknown = sorted({t.split(".")[-1] for t in targets} - set(SUPPORTED_TARGETS))
    if unknown:
        raise _refuse(
            path,
            f"target modules {unknown} are not among the supported {list(SUPPORTED_TARGETS)}",
        )
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    return rank, float(scaling)


def _finite_alpha(path: Path, alpha: int | float) -> float:
    """`alpha` as a float if it is finite, positive and a finite float32: the scaling (alpha
    over the rank or its root, never more than alpha) goes into the per-row mask's float32."""
    try:
        value = float(alpha)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or not 0 < value <= torch.finfo(torch.float32).max:
        raise _refuse(path, f"lora_alpha must be a finite positive number, got {alpha!r}")
    return value


def _pair_tensors(
    path: Path, tensors: dict[str, torch.Tensor], rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        # PEFT's names: base_model.model.<module>.lora_A.weight (older: lora_A.<adapter>.weight)
        pieces = name.removeprefix("base_model.model.").split(".")
        which = next((p for p in pieces if p in ("lora_A", "lora_B")), None)
        if which is None or pieces[-1] != "weight":
            raise _refuse(path, f"tensor {name!r} is not a LoRA A or B weight")
        module = ".".join(pieces[: pieces.index(which)])
        halves.setdefault(module, {})[which] = tensor
    modules = {}
    for module, pair in halves.items():
        a, b = pair.get("lora_A"), pair.get("lora_B")
        if a is None or b is None:
            raise _refuse(path, f"{module} has lora_A without lora_B or the reverse")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise _refuse(
                path,
                f"{module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not have rank {rank}",
            )
        if module.split(".")[-1] not in SUPPORTED_TARGETS:
            raise _refuse(path, f"{module} is not one of the supported {list(SUPPORTED_TARGETS)}")
        a, b = a.float(), b.float()  # (a float64 beyond float32's range turns inf here)
        for which, tensor in (("lora_A", a), ("lora_B", b)):
            if not bool(torch.isfinite(tensor).all()):
                raise _refuse(path, f"{module}: {which} holds NaN or infinite values")
        modules[module] = (a, b)
    if not modules:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    return modules


def read_checkpoint(path: str | Path, max_rank: int, max_weights_bytes: int) -> LoRACheckpoint:
    """The adapter in folder `path`, its tensors in float32 on the host; LoRALoadError if it
    cannot be served with slots of rank `max_rank`, or if its weights file is larger than
    `max_weights_bytes` (what the largest adapter the slots could serve may hold: see
    LoRASlots.max_weights_bytes)."""
    folder = Path(path)
    try:
        return _read(folder, max_rank, max_weights_bytes)
    except LoRALoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checkpoint is user input: never a 500
        raise _refuse(folder, f"cannot be read: {type(exc).__name__}: {exc}") from None


def _read(folder: Path, max_rank: int, max_weights_bytes: int) -> LoRACheckpoint:
    if not folder.is_dir():
        raise _refuse(folder, "no such folder")
    config = _read_config(folder)
    rank, scaling = _check_config(folder, config, max_rank)
    try:
        data = read_regular_file(folder / WEIGHTS_FILE, max_weights_bytes)
    except FileNotFoundError:
        raise _refuse(folder, f"no {WEIGHTS_FILE} (only safetensors weights are read)") from None
    except FileTooLarge as exc:
        raise _refuse(
            folder, f"{exc} (the most an adapter of rank {max_rank} for this model can hold)"
        ) from None
    except FileRefused as exc:
        raise _refuse(folder, str(exc)) from None
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds for a bad file
        raise _refuse(folder, f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None
    modules = _pair_tensors(folder, tensors, rank)
    base = config.get("base_model_name_or_path")
    return LoRACheckpoint(rank, scaling, modules, base if isinstance(base, str) else None)
