"""Start real servers for end-to-end tests: ours (`python -m app serve`) and upstream llama-server."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from app.bench.report import LIB_DIR, free_port, stop_process, wait_healthy


def upstream_server_bin() -> Path:
    path = LIB_DIR / "bin" / "llama-server"
    if not path.exists():
        pytest.skip("upstream llama-server not built (python3 build.py engine --with-upstream-tools)")
    return path


@contextlib.contextmanager
def running_server(kind: str, model: Path, args: list[str]) -> Iterator[str]:
    port = free_port()
    common = ["-m", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    if kind == "ours":
        cmd = [sys.executable, "-m", "app", "serve", "--preset", "none", *common]
    else:
        cmd = [str(upstream_server_bin()), *common]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{kind}-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(base, proc, timeout_s=120, log_path=Path(log.name))
        except SystemExit as e:
            log.seek(0)
            raise RuntimeError(f"{e}\n--- log tail ---\n{log.read()[-4000:]}") from None
        yield base
    finally:
        stop_process(proc)
        log.close()
