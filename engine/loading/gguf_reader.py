"""The `gguf` package's reader, opened so that a file cut short names the tensor it cuts: the
package's own reader fails on such a file with a numpy reshape error that names neither. Its
header (metadata and the tensors' table) is read as the package reads it; before the tensors'
data are mapped, each tensor's extent is checked against the file's size."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelLoadError


class TensorPastEnd(ValueError):
    def __init__(self, name: str, kind: str, needed: int, held: int) -> None:
        super().__init__(f"tensor {name} ({kind}) needs {needed} bytes, the file holds {held}")
        self.name = name


@functools.cache
def _reader_class() -> type:
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            size = int(self.data.size)
            for field in fields:
                # A tensor's table entry: name length, name, dimension count, dimensions, type,
                # offset of its data from the start of the data section.
                if len(field.parts) != 6:  # another table layout: the package's checks only
                    break
                _, name, _, dims, raw_type, offset = field.parts
                kind = gguf.GGMLQuantizationType(int(raw_type[0]))
                block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
                needed = int(np.prod(dims)) * block_bytes // block
                start = int(start_offs + offset[0])
                if start + needed > size:
                    raise TensorPastEnd(
                        bytes(name).decode(errors="replace"),
                        kind.name,
                        needed,
                        max(0, size - start),
                    )
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader of `path`; what cannot be read is a ModelLoadError naming the file
    (and the tensor, where the file is cut inside one)."""
    try:
        return _reader_class()(path)
    except TensorPastEnd as exc:
        raise ModelLoadError(f"{path}: {exc}: the file is truncated or corrupt") from exc
    except Exception as exc:  # a truncated or corrupt header: numpy and struct errors alike
        raise ModelLoadError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from exc
