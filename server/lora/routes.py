"""vLLM's run-time adapter routes (with --allow-runtime-lora-updating): answered, as vLLM
answers them, with a line of text on success and an error object otherwise."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.client import EngineClient
from server.lora.registry import LoRARegistry


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(min_length=1)


def lora_router(loras: LoRARegistry, engine: EngineClient) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await loras.load(engine, req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await loras.unload(engine, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router
