"""JSON and YAML read strictly: a key given twice in one mapping is an error, never "the last one
wins" (both libraries' default), so a file that says two things about one field is refused."""

from __future__ import annotations

import json
from typing import Any

import yaml


class DuplicateKeyError(ValueError):
    """A mapping in the file names one key twice."""


def _unique(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key {key!r} given twice in one mapping")
        out[key] = value
    return out


def loads_json(text: str) -> Any:
    """``json.loads`` that refuses a key given twice (DuplicateKeyError, a ValueError)."""
    return json.loads(text, object_pairs_hook=_unique)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKeyError(
                    f"key {key!r} given twice in one mapping (line {key_node.start_mark.line + 1})"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def loads_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice (DuplicateKeyError, a ValueError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds plain data only
