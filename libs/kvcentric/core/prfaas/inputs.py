"""Readers for the planner's input files that check each field and name it in the error; they hold no policy.

A field is named by its path from the top of the file, e.g. `profile: prfaas.prefill_s[2]: must be > 0`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """A bad input file or field; the message names the file kind and the field."""


def load_document(path: str | Path, kind: str) -> dict:
    """A JSON object from `path` (YAML too when the name ends in .yaml/.yml); errors name `kind`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"{kind}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise InputError(f"{kind}: {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from None
    return mapping(data, kind, "")


class Fields:
    """Typed getters over one JSON object; every error names `kind` and the field's path."""

    def __init__(self, data: Any, kind: str, path: str = "") -> None:
        self.data = mapping(data, kind, path)
        self.kind, self.path = kind, path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> InputError:
        return InputError(f"{self.kind}: {self.name(key)}: {message}")

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str, default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise self.fail(key, "missing")
            return default
        return self.data[key]

    def number(self, key: str, default: Any = ..., minimum: float | None = None, positive: bool = False) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, f"expected a finite number, got {value!r}")
        if positive and value <= 0:
            raise self.fail(key, f"must be > 0, got {value}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return float(value)

    def integer(self, key: str, default: Any = ..., minimum: int | None = None) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def text(self, key: str, default: Any = ..., choices: tuple[str, ...] = ()) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"expected a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise self.fail(key, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")
        return value

    def numbers(self, key: str, positive: bool = True, min_items: int = 1) -> list[float]:
        value = self.raw(key)
        if not isinstance(value, list) or len(value) < min_items:
            raise self.fail(key, f"expected a list of at least {min_items} numbers, got {value!r}")
        for index, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
                raise self.fail(f"{key}[{index}]", f"expected a finite number, got {item!r}")
            if positive and item <= 0:
                raise self.fail(f"{key}[{index}]", f"must be > 0, got {item}")
        return [float(item) for item in value]

    def child(self, key: str) -> Fields:
        return Fields(self.raw(key), self.kind, self.name(key))

    def reject_unknown(self, known: tuple[str, ...]) -> None:
        unknown = sorted(set(self.data) - set(known))
        if unknown:
            where = f"{self.path}: " if self.path else ""
            raise InputError(f"{self.kind}: {where}unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")


def mapping(data: Any, kind: str, path: str) -> dict:
    if not isinstance(data, dict):
        where = path or "the top level"
        raise InputError(f"{kind}: {where}: expected an object, got {type(data).__name__}")
    return data
