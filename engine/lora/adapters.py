"""The engine's adapters between steps: the slot each step's adapters take (`SlotAssignment`),
and the adapters unloaded while requests still ran under them, forgotten once the last ends."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from engine.lora.assignment import SlotAssignment
from engine.lora.checkpoint import LoRALoadError
from engine.lora.request import LoRARequest
from engine.lora.slots import PlacedAdapter


class AdapterStore(Protocol):
    """Where adapters are read, kept and loaded into slots: the executor."""

    def read_lora(self, request: LoRARequest, prepared: PlacedAdapter | None = None) -> None: ...

    def load_lora(self, slot: int, request: LoRARequest) -> None: ...

    def forget_lora(self, request: LoRARequest) -> None: ...


class LoRAAdapters:
    def __init__(self, num_slots: int, store: AdapterStore) -> None:
        self.assignment = SlotAssignment(num_slots)
        self.store = store
        # Adapters unloaded while requests still ran under them: dropped when the last ends.
        self.unloading: set[LoRARequest] = set()

    def add(self, request: LoRARequest, prepared: PlacedAdapter | None = None) -> None:
        """Read and check an adapter now (LoRALoadError), kept on the host for a slot;
        `prepared`: what was read of it already."""
        self.store.read_lora(request, prepared)
        self.unloading.discard(request)  # served again: no longer to be dropped

    def remove(self, request: LoRARequest) -> None:
        """To be forgotten once no request runs or waits under it (`drop_unloaded`)."""
        self.unloading.add(request)

    def drop_unloaded(self, busy: Iterable[LoRARequest | None]) -> list[str]:
        """Forget every unloaded adapter that no request runs or waits under (`busy`: the
        adapters of those that do); the names of those forgotten."""
        dropped = []
        for request in self.unloading - set(busy):
            self.unloading.discard(request)
            self.assignment.drop(request)
            self.store.forget_lora(request)
            dropped.append(request.lora_name)
        return dropped

    def place(self, needed: Iterable[LoRARequest]) -> tuple[LoRARequest, LoRALoadError] | None:
        """Every adapter a step runs under in a slot; else the adapter that could not be loaded
        (its folder gone or changed since it was checked, its host copy dropped) and why."""
        loading: list[LoRARequest] = []

        def load(slot: int, request: LoRARequest) -> None:
            loading.append(request)
            self.store.load_lora(slot, request)

        try:
            self.assignment.place(needed, load)
        except LoRALoadError as exc:
            return loading[-1], exc
        return None
