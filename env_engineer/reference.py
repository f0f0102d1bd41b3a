"""``env-engineer reference``: docs/reference/ written from the code itself, so that it cannot drift from it.

- ``params.md``: every section of ``params.yaml`` and each of its fields (type, default, description), from the typed
  settings of :mod:`pipeline.params`;
- ``environment.md``: the environment configuration's fields and ranges (:mod:`envgen.core.config`);
- ``datasets.md``: every Parquet dataset's columns and rules (:mod:`envgen.formats.schemas`);
- ``commands.md``: every ``env-engineer`` command's ``--help`` (the argument parsers), and the engineers.

``--check`` compares instead of writing, and exits 1 naming the files that differ (the test suite runs it).
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

HEADER = "<!-- Written by `env-engineer reference --out docs/reference`; edit the code, not this file. -->\n\n"


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    return text.replace("NoneType", "None").replace("pipeline.params.", "").replace("envgen.", "")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return "(a default object)"
    return f"`{field.default!r}`"


def params_page() -> str:
    from pydantic import BaseModel

    from pipeline.params import Params

    lines = [HEADER + "# params.yaml: every section and field", "",
             "Each section is typed once in `pipeline/params.py` (`train` in `pipeline/train_settings.py`); every step reads it through one loader and takes "
             "overrides as `--set section.key=value` (the words of `dvc exp run -S`). A wrong section, field or value "
             "is an error naming it and the fix, before anything runs.", ""]
    seen: dict[type, str] = {}
    for section, field in Params.model_fields.items():
        lines += [f"## `{section}`", "", _cell(field.description or ""), ""]
        model = typing.get_args(field.annotation)[0] if typing.get_origin(field.annotation) is list else field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            lines += _field_tables(model, section, seen)
    return "\n".join(lines)


def _field_tables(model: Any, path: str, seen: dict[type, str]) -> list[str]:
    """The table of ``model``'s fields, then one for each field that is itself a settings model (once per model: a
    model met again, such as ``start.train``, points to where its table is)."""
    from pydantic import BaseModel

    if model in seen:
        return [f"The fields of [`{seen[model]}`](#{seen[model].replace('.', '')}).", ""]
    seen[model] = path
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, sub in model.model_fields.items():
        lines.append(f"| `{name}` | {_cell(_type_name(sub.annotation))} | {_cell(_default(sub))} | "
                     f"{_cell(sub.description or '')} |")
        if isinstance(sub.annotation, type) and issubclass(sub.annotation, BaseModel):
            nested.append((name, sub))
    lines.append("")
    for name, sub in nested:
        lines += [f"### `{path}.{name}`", "", _cell(sub.description or ""), ""]
        lines += _field_tables(sub.annotation, f"{path}.{name}", seen)
    return lines


def environment_page() -> str:
    from envgen.core.config import describe_fields

    return "\n".join([HEADER + "# The environment configuration", "",
                      "What an engineer writes for the next stage (`data/stages/K/config.yaml`; `envgen/core/config.py`). "
                      "`env-engineer validate-config FILE` checks one, `env-engineer config-schema` prints its JSON "
                      "schema.", "", describe_fields(), ""])


def datasets_page() -> str:
    from envgen.formats.schemas import DATASETS

    lines = [HEADER + "# The datasets", "",
             "Every Parquet file the pipeline writes, declared once in `envgen/formats/schemas.py`; `env-engineer check-data "
             "--kind NAME FILE` checks one with its great-expectations suite, as every stage does.", ""]
    for name, data in DATASETS.items():
        lines += [f"## `{name}`", "", data.description, "", "| column | type | required | range or values | "
                  "description |", "|---|---|---|---|---|"]
        for c in data.columns:
            bounds = (f"{c.lo if c.lo is not None else ''}..{c.hi if c.hi is not None else ''}"
                      if c.lo is not None or c.hi is not None else ", ".join(c.values or ()) or (c.regex or ""))
            lines.append(f"| `{c.name}` | {c.type} | {'yes' if c.required else ''}{' (unique)' if c.unique else ''} "
                         f"| {_cell(bounds)} | {_cell(c.description)} |")
        rules = [f"`{p.a}` {'>=' if p.op == 'ge' else '=='} `{p.b}`" for p in data.pairs]
        rules += [f"{r.name}: {r.description}" + (f" (a sample of {r.sample})" if r.sample else "")
                  for r in data.meaning]
        if rules:
            lines += ["", "Rules: " + "; ".join(rules) + "."]
        lines.append("")
    return "\n".join(lines)


def commands_page(commands: dict[str, tuple[str, Any, str, str]]) -> str:
    """The commands page from the command table (``env_engineer.cli.commands()``, which the CLI hands over)."""
    from pipeline.params import ENGINEER_LINES

    lines = [HEADER + "# Commands", "", "`env-engineer COMMAND --help` prints each of these.", "",
             "## Engineers", "", "| engineer | what it does |", "|---|---|",
             *[f"| `{k}` | {_cell(v)} |" for k, v in ENGINEER_LINES.items()], ""]
    for name, (help_text, module, add_args, _) in commands.items():
        command = argparse.ArgumentParser(prog=f"env-engineer {name}", description=help_text.replace("%%", "%"),
                                          formatter_class=lambda prog: argparse.HelpFormatter(prog, width=110))
        getattr(module, add_args)(command)
        lines += [f"## `{name}`", "", "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def pages(commands: dict[str, tuple[str, Any, str, str]]) -> dict[str, str]:
    """Every page of docs/reference/ and its text."""
    return {"params.md": params_page(), "environment.md": environment_page(), "datasets.md": datasets_page(),
            "commands.md": commands_page(commands)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs/reference"), help="the folder (default %(default)s)")
    parser.add_argument("--check", action="store_true", help="compare with the folder instead of writing; exit 1 "
                        "naming the pages that differ")


def run(args: argparse.Namespace) -> int:
    from envgen.core.files import atomic_write_text

    stale = []
    written = pages(args.commands())  # the CLI's command table, handed over with the arguments
    for name, text in written.items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            atomic_write_text(path, text)
    if stale:
        print(f"error: {', '.join(stale)} differ from the code; run `env-engineer reference --out {args.out}`",
              file=sys.stderr)
        return 1
    print(f"{'checked' if args.check else 'wrote'} {', '.join(written)} in {args.out}")
    return 0
