"""A test-only launcher: `pagedserve` in a process that has shown a tqdm progress bar first, as
a first start does while transformers converts the default model's GGUF (two bars). The bar
starts tqdm's monitor thread; the launcher prints the threads then running, so that a test can
see the monitor was there. Run as `python -m tests.support.serve_after_progress_bar serve ...`
from the repository root."""

from __future__ import annotations

import sys
import threading

from tqdm import tqdm

from server import cli

if __name__ == "__main__":
    for _ in tqdm(range(3), desc="converting"):
        pass
    print("threads before serving:", [t.name for t in threading.enumerate()], flush=True)
    sys.exit(cli.main())
