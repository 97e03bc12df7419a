"""A child for tests/project/test_childproc.py's pools: each request {"sleep": s} sleeps s seconds
(a hang, when s is long), then replies with its process id; {"restart": true} is echoed back."""

from __future__ import annotations

import os
import time

from realizar_backend.childproc import RESTART, ParentChannel


def worker_main(argv: list[str]) -> None:
    parent = ParentChannel()
    parent.reply({"ready": True})
    for req in parent.requests():
        time.sleep(req.get("sleep", 0))
        parent.reply({"pid": os.getpid(), RESTART: bool(req.get(RESTART))})
