"""Which adapter a request runs under: vLLM's `LoRARequest`, by the same names."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` is what clients call it, `lora_int_id` (> 0) tells adapters apart in the
    engine, `lora_path` is a PEFT checkpoint folder (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_salt(self) -> bytes:
        """What the first KV block's hash starts from: two adapters never share a prefix (their
        K/V differ from the first layer on), and the same name loaded from another folder is
        another adapter."""
        key = f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode()
        return hashlib.blake2b(key, digest_size=16).digest()
