"""Checks that run before anything heavy loads (a model, a worker process): the port is
free and the model exists. Each failure is one ``ValueError`` naming the problem, which
the CLI prints once and exits 2 — instead of a traceback after the model has loaded."""

from __future__ import annotations

import json
import os
import socket

from xlserve.loader.model_source import resolve_model
from xlserve.models.registry import MODEL_REGISTRY


def check_port(host: str, port: int) -> None:
    """Bind and release ``host:port`` the way uvicorn binds it (SO_REUSEADDR, so a port in
    TIME_WAIT still counts as free); port 0 is always free."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; is another server "
                             "running there? Pick another --port.") from None


def check_model(model: str) -> None:
    """``--model`` resolves to a file or directory, and a Hugging Face directory names an
    architecture this build serves (weights are not read)."""
    source = resolve_model(model)
    if source.kind != "hf":
        return
    try:
        with open(os.path.join(source.path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {model}/config.json: {e}") from None
    names = config.get("architectures") or []
    if not any(name in MODEL_REGISTRY for name in names):
        raise ValueError(f"model {model!r} is a {', '.join(names) or 'model without architectures'}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
