"""The server address a client is pointed at (``--url``), shared by the HTTP replay target and the
monitor; kept free of the replay driver's imports so the monitor starts without torch."""
from __future__ import annotations


def api_base(url: str) -> str:
    """``http://host:port`` or ``.../v1`` -> ``http://host:port``."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"bad --url {url!r}: expected http://HOST:PORT")
    return base[:-3] if base.endswith("/v1") else base
