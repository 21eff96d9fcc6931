"""Prepares a loaded model for the CPU: prepacked linear weights, the fused elementwise ops
and the C++ loop over its layers, each where it applies, with the log saying why not where not.
"""

from __future__ import annotations

import logging

from engine.models.base import DecoderModel
from engine.models.interface import CausalLM
from engine.models.layers.linear import PackableLinear
from engine.worker.cpu.layer_stack import stack_cpu_layers
from kernels.attention import AttentionBackend
from kernels.cpu import packed_linear
from kernels.cpu.packed_linear import can_pack, pack

log = logging.getLogger(__name__)


def pack_weights(model: CausalLM, fixed_order: bool = False) -> bool:
    """Prepack every linear weight for the CPU's fastest bfloat16 kernel
    (kernels/cpu/packed_linear), after loading; the unpacked copies are dropped, but the
    embedding's, which the lookup still reads. False if the weights cannot be packed here.
    `fixed_order`: for kernels/cpu/bf16_linear whatever this CPU prefers (--batch-invariant);
    a weight it cannot take is then an error, not a layer left to oneDNN."""
    own = fixed_order or packed_linear.own_layout()
    if not isinstance(model, DecoderModel):
        return False
    if not can_pack(model.embed_tokens.weight, own):
        if fixed_order:
            raise ValueError(
                "--batch-invariant: the weights cannot take the fixed-order linear kernel"
            )
        return False
    if model.tie_word_embeddings and model.lm_head_quantized is None:
        model.lm_head_packed = pack(model.embed_tokens.weight, own)
        model.lm_head_packed_own = own
    for name, module in model.named_modules():
        weight = module.weight if isinstance(module, PackableLinear) else None
        if weight is None:  # not a linear, or quantized (--quantization)
            continue
        if not can_pack(weight, own):
            if fixed_order:
                raise ValueError(
                    f"--batch-invariant: {name} cannot take the fixed-order linear kernel"
                )
            continue
        assert isinstance(module, PackableLinear)
        module.packed, module.packed_own = pack(weight, own), own
        module.register_parameter("weight", None)
    return True


def fuse_ops(model: CausalLM) -> str | None:
    """Run the norms, residual adds, rotary and SiLU-mul through kernels/cpu/fused_ops (built
    with the package). None when done, else why not: the layers then keep their torch ops."""
    if not isinstance(model, DecoderModel):
        return "not a decoder model"
    if model.embed_tokens.weight.device.type != "cpu":
        return "not on the CPU"
    try:
        from kernels.cpu import fused_ops
    except ImportError as exc:  # not built, or not for this CPU
        return f"kernels.cpu.fused_ops does not load: {exc}"
    model.fused_ops = fused_ops
    return None


def prepare_model(
    model: CausalLM,
    backend: AttentionBackend,
    log_here: bool,
    fixed_order: bool = False,
    lora: bool = False,
) -> None:
    """Everything above that applies to `model` on the CPU under `backend` (not with
    --enforce-eager: the caller does not call this then). `log_here`: this rank logs;
    `fixed_order`: linears through the fixed-order kernel (--batch-invariant); `lora`: the
    linears take LoRA adapters, which the C++ layer loop does not apply: a step with an
    adapter's rows runs the Python layers instead."""
    if pack_weights(model, fixed_order) and log_here:
        kernel = (
            "kernels/cpu/bf16_linear" if fixed_order or packed_linear.own_layout() else "oneDNN"
        )
        log.info(
            "linear weights prepacked for %s (bfloat16 on the CPU; --enforce-eager keeps them as loaded)",
            kernel,
        )
    why_not = fuse_ops(model)
    if why_not is not None and log_here:
        log.warning("norms, rotary and SiLU stay torch ops (slower): %s", why_not)
    # The loop is the cpu backend's path: under another backend it would never run.
    if backend.name == "cpu":
        why_not = stack_cpu_layers(model)
    else:
        why_not = f"the {backend.name} attention backend"
    if log_here:
        if why_not is None and lora:
            log.info(
                "decoder layers run in one C++ loop on the CPU, but from Python in steps with "
                "LoRA adapter rows (the loop does not apply adapters)"
            )
        elif why_not is None:
            log.info("decoder layers run in one C++ loop on the CPU (--enforce-eager: Python)")
        else:
            log.info("decoder layers run from Python: %s", why_not)
