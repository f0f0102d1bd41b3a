"""YAML from files and command lines that may be hostile, read within bounds: the project's one YAML loader.

Safe tags only (no ``!!python``); anchors and aliases allowed as long as the document they describe stays under
:data:`MAX_VALUES` values once every alias is expanded (a few hundred bytes of nested aliases can otherwise describe
billions), and never recursive; at most :data:`MAX_DEPTH` levels of nesting and :data:`MAX_CHARS` characters; UTF-8
text. Anything else is a
:class:`YAMLInputError` whose message names the file, the line where known, and the fix: never a traceback, and never
an echo of the input beyond a short excerpt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_CHARS = 1_000_000
"""Longest YAML text accepted (a configuration or params file is a few kilobytes)."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists accepted."""
MAX_VALUES = 100_000
"""Most values (scalars, mappings, lists) a document may hold with its aliases expanded (a params file holds ~300)."""


class YAMLInputError(ValueError):
    """YAML that cannot be used; the message names the source, the place and the fix."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a nesting limit."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nesting deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def expanded_size(node: Any, limit: int = MAX_VALUES) -> int:
    """How many values the composed ``node`` holds with every alias expanded (shared nodes counted at each use); stops
    counting past ``limit``. A recursive alias raises ``ComposerError``."""
    memo: dict[int, int] = {}
    busy: set[int] = set()

    def size(n: Any) -> int:
        key = id(n)
        if key in memo:
            return memo[key]
        if key in busy:
            raise yaml.composer.ComposerError(None, None, "a recursive alias: a value that contains itself", n.start_mark)
        busy.add(key)
        total = 1
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                total += size(k) + size(v)
                if total > limit:
                    break
        elif isinstance(n, yaml.SequenceNode):
            for v in n.value:
                total += size(v)
                if total > limit:
                    break
        busy.discard(key)
        memo[key] = total
        return total

    return size(node)


def load(text: str, source: str = "<yaml>") -> Any:
    """The value of the YAML document ``text`` (``source`` names it in errors)."""
    if len(text) > MAX_CHARS:
        raise YAMLInputError(f"{source}: {len(text):,} characters of YAML; at most {MAX_CHARS:,} are read")
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_size(node) > MAX_VALUES:
            raise yaml.composer.ComposerError(None, None, f"its aliases expand to more than {MAX_VALUES:,} values",
                                              node.start_mark)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = str(getattr(e, "problem", None) or str(e).splitlines()[0])[:200]
        what = "YAML refused" if problem.startswith(("its aliases", "a recursive", "nesting deeper")) else "not valid YAML"
        raise YAMLInputError(f"{where}: {what} ({problem})") from None
    except RecursionError:
        raise YAMLInputError(f"{source}: nesting too deep to read (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # a number of more than 4,300 digits, a date out of range
        raise YAMLInputError(f"{source}: a value cannot be read ({str(e)[:160]})") from None
    finally:
        loader.dispose()


def read(path: str | Path) -> Any:
    """The value of the YAML file ``path``."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > 4 * MAX_CHARS:
            raise YAMLInputError(f"{path}: {size:,} bytes; a YAML file of at most {MAX_CHARS:,} characters is read")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise YAMLInputError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise YAMLInputError(f"{path}: cannot be read ({e.strerror or e})") from None
    return load(text, str(path))
