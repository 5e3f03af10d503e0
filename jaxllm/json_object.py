"""One parser for options that take a JSON object (host-only, imported by config modules that
jaxllm/config.py itself imports, hence its own file)."""

from __future__ import annotations

import json
from typing import Optional, Union


def json_object(value: Union[str, dict, None], what: str = "value",
                kind: str = "JSON object") -> Optional[dict]:
    """A JSON object given as text or already a dict -> dict (None stays None). Shared by every
    option that takes one (flags here, `--speculative-config`, structured-output schemas) so they
    refuse the same mistakes with the same words, naming `what`."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a {kind}, got {value!r}")
    return value

