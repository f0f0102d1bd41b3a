"""YAML from files and command lines that may be hostile, read within bounds: the project's one YAML loader.

Values are read as YAML 1.2 reads them, as DVC (ruamel.yaml) writes and reads ``params.yaml``: ``010`` is ten,
``1:30`` and ``on`` are text, ``1e-5`` is a number; PyYAML alone reads YAML 1.1 (eight, ninety, true, text). A mapping
that gives a key twice is refused (YAML leaves it undefined; PyYAML kept the last). Safe tags only (no ``!!python``);
anchors and aliases allowed as long as the document they describe stays under :data:`MAX_VALUES` values once every
alias is expanded (a few hundred bytes of nested aliases can otherwise describe billions), and never recursive; at
most :data:`MAX_DEPTH` levels of nesting and :data:`MAX_CHARS` characters; UTF-8 text of printable characters; a file
that is a regular file. Anything else is a :class:`YAMLInputError` whose message names the file, the line where known,
and the fix: never a traceback, and never an echo of the input beyond a short excerpt.
"""

from __future__ import annotations

import re
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
    """PyYAML's safe loader with YAML 1.2's core schema, a nesting limit and no duplicate keys."""

    yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers
                                       if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int",
                                                      "tag:yaml.org,2002:float")]
                               for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"the key {str(key)[:40]!r} is given twice (also on line "
                            f"{seen[key].line + 1}); keep one", key_node.start_mark)
                    seen[key] = key_node.start_mark
                except TypeError:  # an unhashable key: PyYAML refuses it below
                    pass
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nesting deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution), as ruamel.yaml and so DVC read it
_BoundedLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                     list("tTfF"))
_BoundedLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                     list("-+0123456789"))
_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))


def _int_12(loader: yaml.SafeLoader, node: Any) -> int:
    text = loader.construct_scalar(node)
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text)  # YAML 1.2: 010 is ten


def _float_12(loader: yaml.SafeLoader, node: Any) -> float:
    text = loader.construct_scalar(node).lower()
    if text.endswith(".inf"):
        return float("-inf") if text.startswith("-") else float("inf")
    return float("nan") if text == ".nan" else float(text)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _int_12)
_BoundedLoader.add_constructor("tag:yaml.org,2002:float", _float_12)


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
    loader = None
    try:
        loader = _BoundedLoader(text)  # its reader refuses control characters already
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_size(node) > MAX_VALUES:
            raise yaml.composer.ComposerError(None, None, f"its aliases expand to more than {MAX_VALUES:,} values",
                                              node.start_mark)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        if isinstance(e, yaml.reader.ReaderError):  # a control character, U+FFFE, a byte that is not text
            line = text.count("\n", 0, e.position) + 1
            raise YAMLInputError(f"{source}:{line}: not valid YAML (a control character, code {e.character!r}, at "
                                 f"position {e.position}); remove it") from None
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = str(getattr(e, "problem", None) or str(e).splitlines()[0])[:200]
        refused = ("its aliases", "a recursive", "nesting deeper", "the key ")
        what = "YAML refused" if problem.startswith(refused) else "not valid YAML"
        raise YAMLInputError(f"{where}: {what} ({problem})") from None
    except RecursionError:
        raise YAMLInputError(f"{source}: nesting too deep to read (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # a number of more than 4,300 digits, a date out of range
        raise YAMLInputError(f"{source}: a value cannot be read ({str(e)[:160]})") from None
    finally:
        if loader is not None:
            loader.dispose()


def read(path: str | Path) -> Any:
    """The value of the YAML file ``path`` (a regular file of at most 4 x :data:`MAX_CHARS` bytes)."""
    from envgen.core.files import InputFileError, read_text_bounded

    try:
        text = read_text_bounded(path, 4 * MAX_CHARS, "YAML file")
    except InputFileError as e:
        raise YAMLInputError(str(e)) from None
    return load(text, str(path))
