"""Plain HTTP calls from tests, answering the status code (errors included) rather than raising."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def http_status(url: str, method: str = "GET", headers: dict | None = None, body: dict | None = None,
                timeout: float = 60.0) -> int:
    """The status of one request; a POST sends `body` (or {}) as JSON. 0 when nothing answers."""
    data = json.dumps(body or {}).encode() if method == "POST" else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0
