"""`app serve`: resolve settings, bind the listening sockets, serve until a signal (or a failed model load).

Sockets are bound before the model loads, so a port already in use fails at once, and /health answers 503
while the weights are read, as llama-server does.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from typing import Any, Callable

from aiohttp import web

from app.config import ConfigError, HelpRequested, Settings, layer_sources, load_settings

log = logging.getLogger("app.server")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname).1s %(name)s: %(message)s", stream=sys.stderr)
    # per-request access lines only when debugging: at serving rates they drown everything else
    logging.getLogger("aiohttp.access").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _listeners(settings: Settings) -> tuple[list[socket.socket], list[str], list[str]]:
    """(TCP sockets, UNIX socket paths, announced addresses) for --host/--port."""
    socks, paths, names = [], [], []
    for host in settings.http.hosts:
        if host.endswith(".sock"):
            paths.append(host)
            names.append(f"unix://{host}")
            continue
        try:
            sock = _bind(host, settings.http.port)
        except OSError as e:
            for s in socks:
                s.close()
            raise ConfigError(f"cannot listen on {host}:{settings.http.port}: {e.strerror or e}") from None
        socks.append(sock)
        names.append(_url(sock))
    return socks, paths, names


def resolve_settings(argv: list[str], default_model: str | None = None) -> tuple[Settings, str]:
    """Settings from defaults < preset < --config file < environment < command line, and the preset's log line."""
    if any(a in ("-h", "--help") for a in argv):  # help needs no GPU discovery, nor a valid preset
        return load_settings(argv, default_model=default_model), ""
    from app.presets import config_file_layer, preset_layer

    preset_name, config_path = layer_sources(argv)
    preset, preset_line = preset_layer(preset_name)  # discovers the GPUs unless --preset names one
    layers = [preset] + ([config_file_layer(config_path)] if config_path else [])
    return load_settings(argv, layers=layers, default_model=default_model), preset_line


def run_server(argv: list[str], *, runtime_factory: Callable[[Any], Any] | None = None,
               default_model: str | None = None) -> int:
    """Serve until interrupted; returns the process exit code (0 ok, 1 model failed to load, 2 bad flags)."""
    try:
        settings, preset_line = resolve_settings(argv, default_model)
    except HelpRequested as h:
        print(h.text)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if preset_line:
        log.info("%s", preset_line)
    if not settings.model.path:
        print("error: no model to serve: pass -m/--model PATH (or set LLAMA_ARG_MODEL)", file=sys.stderr)
        return 2
    try:
        socks, paths, names = _listeners(settings)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    failed: list[str] = []

    def on_load_failure(message: str) -> None:
        failed.append(message)
        # GracefulExit raised from a loop callback ends web.run_app the same way SIGINT does
        asyncio.get_running_loop().call_soon(_graceful_exit)

    def announce(_aiohttp_banner: str) -> None:
        for name in names:
            print(f"listening on {name}", flush=True)

    from app.server.app import create_app  # here: importing the server stack is not needed for --help

    app = create_app(settings, runtime_factory, on_load_failure=on_load_failure)
    web.run_app(
        app, sock=socks or None, path=paths or None, print=announce, handler_cancellation=True,
        keepalive_timeout=float(settings.http.timeout), shutdown_timeout=5.0, access_log=logging.getLogger(
            "aiohttp.access"),
    )
    return 1 if failed else 0


def _graceful_exit() -> None:
    raise web.GracefulExit()
