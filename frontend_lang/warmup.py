"""Warm spans from an SGLang program's backend: prefill documents into the cache before the prompts that use them."""

from __future__ import annotations

from typing import Any


def warm_spans(backend: Any, spans: list[str]) -> dict[str, int]:
    """`backend` is an `sgl.RuntimeEndpoint` pointing at our server, or an `EngineBackend`."""
    engine = getattr(backend, "engine", None)
    if engine is not None:
        return engine.warm_spans(spans)
    import requests

    headers = {"Authorization": f"Bearer {backend.api_key}"} if getattr(backend, "api_key", None) else {}
    res = requests.post(backend.base_url + "/warm_spans", json={"spans": spans}, headers=headers, timeout=None)
    if res.status_code != 200:
        raise RuntimeError(res.text)
    return res.json()
