"""The server's per-application state, reached through one typed `web.AppKey`.

The runtime it holds is anything with the `app.runtime.service.Runtime` interface (tests pass a fake).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from aiohttp import web

from app import __version__
from app.config import Settings
from app.server.templates import ChatTemplate

T = TypeVar("T")

# text longer than this is tokenized/templated on a worker thread so one big prompt cannot stall the loop;
# shorter text is cheaper to handle inline than to hand to a thread
INLINE_TEXT_LIMIT = 16 * 1024


@dataclass
class ServerState:
    settings: Settings
    runtime: Any
    executor: ThreadPoolExecutor
    template: ChatTemplate | None = None  # built once the model (and its template) is loaded
    load_failed: str | None = None
    started_at: float = field(default_factory=time.time)
    metrics_prev: dict[str, float] = field(default_factory=dict)  # totals at the last /metrics scrape

    @property
    def model_name(self) -> str:
        """The name responses carry: llama-server's first alias, else the model path."""
        ms = self.settings.model
        if ms.alias:
            return ms.alias
        info = getattr(self.runtime, "info", None)
        return (info.alias if info is not None else "") or (ms.path or "")

    @property
    def aliases(self) -> list[str]:
        ms = self.settings.model
        return sorted(ms.aliases) if ms.aliases else [self.model_name]

    async def offload(self, fn: Callable[..., T], *args: Any, size: int = 0) -> T:
        """Run a CPU-bound helper (tokenize, template) inline when small, on a worker thread when large."""
        if size <= INLINE_TEXT_LIMIT:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


STATE: web.AppKey[ServerState] = web.AppKey("rigserve_state", ServerState)


def get_state(request: web.Request) -> ServerState:
    return request.app[STATE]


_BUILD_INFO: str | None = None


def build_info() -> str:
    """`system_fingerprint` / `build_info`: our version plus the engine build's commit when known."""
    global _BUILD_INFO
    if _BUILD_INFO is None:
        commit = ""
        info = Path(__file__).resolve().parent.parent / "_lib" / "build-info.json"
        try:
            commit = str(json.loads(info.read_text()).get("commit", ""))[:9]
        except (OSError, ValueError, AttributeError):
            pass  # no engine build here (tests, a source checkout): the version alone says enough
        _BUILD_INFO = f"rigserve-{__version__}" + (f"-{commit}" if commit else "")
    return _BUILD_INFO
