"""The names of data that really is arbitrary JSON: config.json, quantkit.json, reports read back, HTTP bodies.

Code that reads such data names it with these aliases (the one place `Any` stands for JSON data); data
quantkit builds itself is a dataclass, a TypedDict or a closed set (Literal / Enum) instead.
"""

from __future__ import annotations

from typing import Any

__all__ = ["JSON", "JSONObject", "JSONValue"]

JSON = Any  # one JSON value as json.loads returns it: dict, list, str, int, float, bool or None
JSONObject = dict[str, JSON]  # a JSON object: config.json, quantkit.json, a report, a request or response body
JSONValue = dict[str, object] | list[object] | str | int | float | bool | None  # a value written as JSON
