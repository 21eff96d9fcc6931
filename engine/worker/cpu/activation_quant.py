"""--quantize-activations int8: the quantized linears of a loaded model (the tied head too) marked
to take their activations rounded to int8 (kernels/cpu/quant_linear's integer path): 4-bit and
8-bit weights alike (an 8-bit one as q + 128 against the activations, the offset taken back off
exactly), wherever a weight group is whole blocks of 32 inputs."""

from __future__ import annotations

from config import ConfigError
from engine.models.base import DecoderModel
from engine.models.interface import CausalLM
from engine.models.layers.linear import PackableLinear
from kernels.cpu.activation_quant import BLOCK
from kernels.cpu.quant_layout import PackedWeight


def takes_int8_activations(weight: PackedWeight) -> bool:
    """In groups of whole activation blocks (each block then has one weight scale): groups of 32
    or a multiple, or the whole row where its length is one."""
    groups = weight.scales.shape[1]
    return (weight.k // groups) % BLOCK == 0


def use_int8_activations(model: CausalLM, named: bool = True) -> tuple[int, int]:
    """Mark every linear that can take int8 activations; (marked, quantized linears in all).
    Where the flag names them (`named`) a model with none to mark is refused: the flag would
    change nothing. A checkpoint that only declares int8 activations then keeps 16-bit ones."""
    if not isinstance(model, DecoderModel):
        if not named:
            return 0, 0
        raise ConfigError("--quantize-activations int8 is for decoder models")
    marked = total = 0
    for module in model.modules():
        if isinstance(module, PackableLinear) and module.quantized is not None:
            total += 1
            module.int8_activations = takes_int8_activations(module.quantized)
            marked += module.int8_activations
    if model.lm_head_quantized is not None:
        total += 1
        model.lm_head_int8_activations = takes_int8_activations(model.lm_head_quantized)
        marked += model.lm_head_int8_activations
    if marked == 0 and named:
        raise ConfigError(
            f"--quantize-activations int8: none of the model's {total} quantized linear weights "
            f"has groups of a multiple of {BLOCK} inputs (nor rows of a multiple of {BLOCK})"
        )
    return marked, total
