"""The streaming client now lives in server/bench/sse_stream.py (installed with the package);
this name stays for the scripts here that import it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.bench.sse_stream import SSEClient, StreamEnd

__all__ = ["SSEClient", "StreamEnd"]
