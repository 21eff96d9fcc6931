"""The adapters this server serves, by the name a request gives in `model`.

Unloading an adapter takes its name away at once (new requests get the unknown model's 404);
requests already running under it finish under it, since each holds its own `LoRARequest`.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from config.lora_names import lora_name_problem
from engine.client import EngineClient, LoRARequest
from server.errors import APIError, invalid


def adapter_not_found(name: str) -> APIError:
    return APIError(
        404, f"The LoRA adapter '{name}' cannot be found", param="lora_name", code="not_found"
    )


@dataclass
class LoRARegistry:
    base_names: list[str]  # the base model's served names: an adapter may not take one
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    # Loads and unloads one at a time: two loads of one name must not both pass the check.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    async def load(
        self, engine: EngineClient, name: str, path: str, base_model_name: str | None = None
    ) -> LoRARequest:
        """Read and check the adapter on the engine (a bad one: LoRALoadError, a 400), then
        serve it under `name` (one outside config/lora_names.py's rule: a 400)."""
        if engine.info.max_loras is None:
            raise invalid("LoRA adapters need a server started with --enable-lora", "lora_name")
        problem = lora_name_problem(name)
        if problem is not None:
            raise invalid(problem, "lora_name")
        async with self._lock:
            if name in self.base_names:
                raise invalid(f"'{name}' is the base model's name", "lora_name")
            if name in self.adapters:
                raise invalid(f"The LoRA adapter '{name}' has already been loaded", "lora_name")
            request = LoRARequest(name, next(self._ids), path, base_model_name)
            await engine.add_lora(request)
            self.adapters[name] = request
            return request

    async def unload(self, engine: EngineClient, name: str) -> None:
        async with self._lock:
            request = self.adapters.pop(name, None)
            if request is None:
                raise adapter_not_found(name)
            await engine.remove_lora(request)
