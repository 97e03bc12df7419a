"""What the OpenAI routes share with the service that loads the engine. Its own module, light to
import: `bentoml serve`'s own process creates the state with the service but never serves, so it
need not import the routes (serving/openai.py) and the engine behind them."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerState:
    """What the routes need; filled in by the service once the model is loaded."""
    settings: Any
    engine: Any = None                    # realizar_backend.engine.engine.Engine once loaded
    metrics: Any = None                   # serving.metrics.Metrics
    load_error: str | None = None
    started: float = 0.0
    draining: bool = False                # SIGTERM seen: new requests get 503 (service.py)
    active: int = 0                       # /v1 requests in flight (read on the event loop only)
    # parsing, tokenizing, template renders, large JSON: blocking work kept off the event loop
    # (many threads: most of them wait, on a template worker or the GIL-free tokenizer)
    work: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(32, "realizar-request"))

    async def offload(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.work, _without_frames, fn, *args)


def _without_frames(fn, *args):
    """fn(*args); an exception leaves without the frames it passed through, so that what they
    held (a parsed body of megabytes) is freed here, on the worker thread, not on the loop."""
    try:
        return fn(*args)
    except Exception as e:
        e.__traceback__ = None
        raise
