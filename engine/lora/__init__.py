"""LoRA adapters: PEFT checkpoints read and checked (`checkpoint`), the slots they occupy on a
model's linear layers (`slots`), and which adapter runs in which slot each step (`assignment`).
The per-row update itself is a layer's (engine/models/layers/lora.py)."""

from engine.lora.checkpoint import LoRACheckpoint, LoRALoadError, read_checkpoint
from engine.lora.request import LoRARequest

__all__ = ["LoRACheckpoint", "LoRALoadError", "LoRARequest", "read_checkpoint"]
