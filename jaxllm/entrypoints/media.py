"""Images named in chat content parts, read into PIL images, as vLLM reads them: `data:` URLs
(base64 PNG, JPEG, WebP, ...), `file://` paths only under --allowed-local-media-path, http(s)
URLs only from --allowed-media-domains (no network fetch otherwise). Every refusal is a
ValueError naming the problem (the server's 400).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import unquote, urlparse

MAX_IMAGE_BYTES = 20 << 20   # an encoded image's size
MAX_IMAGE_PIXELS = 40_000_000  # a decoded image's width x height
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from: --allowed-local-media-path (a folder; None: no local
    files) and --allowed-media-domains (host names; empty: no network fetch)."""
    allowed_local_media_path: Optional[str] = None
    allowed_media_domains: tuple[str, ...] = ()


def decode_image(data: bytes, where: str):
    """Encoded bytes -> a loaded RGB-or-not PIL image, or a ValueError naming the problem."""
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the image is too large ({len(data)} bytes; at most "
                         f"{MAX_IMAGE_BYTES})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{where}: the image is too large ({image.width}x"
                                 f"{image.height} pixels; at most {MAX_IMAGE_PIXELS})")
            image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise ValueError(f"{where}: the image is too large (a decompression bomb)") from None
    except ValueError:
        raise
    except Exception as e:  # PIL's UnidentifiedImageError, truncated files, bad headers...
        raise ValueError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    return image


def load_image(ref: Any, policy: MediaPolicy = MediaPolicy(), where: str = "image_url"):
    """A PIL image (returned as is) or a URL string -> a PIL image."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref
    if not isinstance(ref, str):
        raise ValueError(f"{where}: expected a URL string, got {type(ref).__name__}")
    if ref.startswith("data:"):
        head, sep, payload = ref.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError(f"{where}: a data URL must be data:<type>;base64,<data>")
        if not head[5:].startswith("image/"):
            raise ValueError(f"{where}: data URL of type {head[5:-7]!r} is not an image")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the data URL is not valid base64") from None
        return decode_image(data, where)
    url = urlparse(ref)
    if url.scheme == "file":
        return decode_image(_local_file(unquote(url.path), policy, where), where)
    if url.scheme in ("http", "https"):
        host = (url.hostname or "").lower()
        if host not in policy.allowed_media_domains:
            raise ValueError(f"{where}: fetching images from {host!r} is not allowed (start "
                             "the server with --allowed-media-domains to allow a domain)")
        return decode_image(_fetch(ref, where), where)
    raise ValueError(f"{where}: unsupported URL scheme {url.scheme!r} (data:, file:// under "
                     "--allowed-local-media-path, or http(s) from --allowed-media-domains)")


def _local_file(path: str, policy: MediaPolicy, where: str) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise ValueError(f"{where}: local files are not allowed (start the server with "
                         "--allowed-local-media-path)")
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base:
        raise ValueError(f"{where}: {path!r} is outside --allowed-local-media-path")
    if not os.path.isfile(real):
        raise ValueError(f"{where}: no such file {path!r}")
    if os.path.getsize(real) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the image is too large ({os.path.getsize(real)} bytes; "
                         f"at most {MAX_IMAGE_BYTES})")
    with open(real, "rb") as f:
        return f.read()


def _fetch(url: str, where: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as r:
            if r.status_code != 200:
                raise ValueError(f"{where}: fetching the image gave HTTP {r.status_code}")
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise ValueError(f"{where}: the image is too large (over "
                                     f"{MAX_IMAGE_BYTES} bytes)")
            return bytes(data)
    except httpx.HTTPError as e:
        raise ValueError(f"{where}: fetching the image failed ({type(e).__name__})") from None
