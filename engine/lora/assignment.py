"""Which adapter is in which slot, decided on the engine thread before each step.

The scheduler keeps at most `num_slots` distinct adapters running, so a step's adapters always
fit: one already in a slot stays there, a new one takes an empty slot or the one used longest
ago by an adapter this step does not run. The runner loads it there before the step's forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.lora.request import LoRARequest

BASE = -1  # the slot a row of the base model runs under: none


class SlotAssignment:
    def __init__(self, num_slots: int) -> None:
        self.slots: list[LoRARequest | None] = [None] * num_slots
        self.last_used = [0] * num_slots
        self.clock = 0

    def place(
        self, needed: Iterable[LoRARequest], load: Callable[[int, LoRARequest], None]
    ) -> None:
        """Give every adapter in `needed` a slot, calling `load(slot, adapter)` for each that
        was not in one."""
        self.clock += 1
        wanted = dict.fromkeys(needed)  # (in the order given: the same slots on every run)
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"{len(wanted)} adapters in one step, {len(self.slots)} slots")
        for request in wanted:
            if request in self.slots:
                slot = self.slots.index(request)
            else:
                free = [i for i, held in enumerate(self.slots) if held not in wanted]
                slot = min(free, key=lambda i: (self.slots[i] is not None, self.last_used[i]))
                self.slots[slot] = None  # not the old adapter's if the load fails
                load(slot, request)
                self.slots[slot] = request
            self.last_used[slot] = self.clock

    def slot_of(self, request: LoRARequest | None) -> int:
        return BASE if request is None else self.slots.index(request)

    def drop(self, request: LoRARequest) -> None:
        """Forget an unloaded adapter's slot (its weights stay until another takes it)."""
        for i, held in enumerate(self.slots):
            if held == request:
                self.slots[i] = None
