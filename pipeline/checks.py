"""Data validation with great-expectations: every dataset of :mod:`envgen.formats.schemas` gets a suite derived from its declared
rules (required columns, ranges, uniqueness, patterns, allowed values, rules between columns, least row count) and its
rules of meaning (each computed per row as a column ``rule:<name>`` that must be true: hashes, parsing, plan replays,
the solver on a sample, outcome consistency, rewards within the recorded reward configuration).

``env-engineer check-data --kind instances|benchmark|trajectories|completions FILE`` exits 1 with one line per failed
expectation (column, expectation, a few offending values), so a corrupted or inconsistent Parquet stops the pipeline
in the stage that wrote it. great-expectations is imported only when a file is checked (about 6 s).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envgen.formats.schemas import DATASETS, Dataset


@dataclass(frozen=True)
class Expectation:
    """One great-expectations expectation: its class name and arguments."""

    kind: str
    args: dict[str, Any]

    @property
    def columns(self) -> list[str]:
        return [v for k, v in self.args.items() if k in ("column", "column_A", "column_B")]


def suite(dataset: Dataset) -> list[Expectation]:
    """The expectations of ``dataset``, derived from its columns' rules (list columns are typed by the writer's Arrow
    schema instead)."""
    out = [Expectation("ExpectTableRowCountToBeBetween", {"min_value": dataset.min_rows})] if dataset.min_rows else []
    for c in dataset.columns:
        if c.required:
            out.append(Expectation("ExpectColumnValuesToNotBeNull", {"column": c.name}))
        if c.unique:
            out.append(Expectation("ExpectColumnValuesToBeUnique", {"column": c.name}))
        if c.lo is not None or c.hi is not None:
            out.append(Expectation("ExpectColumnValuesToBeBetween", {"column": c.name, "min_value": c.lo, "max_value": c.hi}))
        if c.regex is not None:
            out.append(Expectation("ExpectColumnValuesToMatchRegex", {"column": c.name, "regex": c.regex}))
        if c.values is not None:
            out.append(Expectation("ExpectColumnValuesToBeInSet", {"column": c.name, "value_set": list(c.values)}))
    for rule in dataset.meaning:
        out.append(Expectation("ExpectColumnValuesToBeInSet", {"column": f"rule:{rule.name}", "value_set": [True]}))
    for rule in dataset.pairs:
        if rule.op == "ge":
            out.append(Expectation("ExpectColumnPairValuesAToBeGreaterThanB",
                                   {"column_A": rule.a, "column_B": rule.b, "or_equal": True}))
        else:
            out.append(Expectation("ExpectColumnPairValuesToBeEqual", {"column_A": rule.a, "column_B": rule.b}))
    return out


def meaning(table: Any, dataset: Dataset, seed: int = 0) -> dict[str, list[bool | None]]:
    """Per rule of meaning, its verdict on every row (None on rows a sampled rule does not check)."""
    import random

    rows = table.to_pylist()
    metadata = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (table.schema.metadata or {}).items()}
    out: dict[str, list[bool | None]] = {}
    for rule in dataset.meaning:
        picked = range(len(rows))
        if rule.sample is not None and len(rows) > rule.sample:
            picked = sorted(random.Random(f"{seed}:{rule.name}").sample(range(len(rows)), rule.sample))
        verdicts: list[bool | None] = [None] * len(rows)
        for i in picked:
            try:
                verdicts[i] = bool(rule.check(rows[i], metadata))
            except Exception:  # noqa: BLE001 - a row the rule cannot even read is a row that breaks it
                verdicts[i] = False
        out[rule.name] = verdicts
    return out


class DataValidationError(RuntimeError):
    """The file breaks its suite; the message lists each failed expectation."""


def validate_file(path: str | Path, kind: str, allow_empty: bool = False) -> int:
    """Validate a Parquet file against the suite of dataset ``kind``; returns the row count or raises. ``allow_empty``:
    a file with the dataset's columns and no row passes (the benchmark answers of a stage that scores no board)."""
    if kind not in DATASETS:
        raise ValueError(f"kind {kind!r}: choose one of {sorted(DATASETS)}")
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - any reader failure is a corrupt or missing file
        raise DataValidationError(f"{path}: cannot be read as Parquet ({type(e).__name__}: {str(e)[:200]})") from None
    dataset = DATASETS[kind]
    expectations = suite(dataset)
    missing = [c for c in dataset.names if c not in table.column_names]
    if missing:
        raise DataValidationError(f"{path}: not a {kind} file: missing columns {missing}")
    if allow_empty and table.num_rows == 0:
        return 0
    frame = table.select(sorted({c for e in expectations for c in e.columns if not c.startswith("rule:")})).to_pandas()
    for name, values in meaning(table, dataset).items():
        frame[f"rule:{name}"] = values

    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (context.data_sources.add_pandas("env_engineer").add_dataframe_asset(kind)
             .add_batch_definition_whole_dataframe("all").get_batch(batch_parameters={"dataframe": frame}))
    gx_suite = gx.ExpectationSuite(name=f"{kind}_suite")
    for e in expectations:
        gx_suite.add_expectation(getattr(gx.expectations, e.kind)(**e.args))
    result = batch.validate(gx_suite, result_format="SUMMARY")
    if not result.success:
        lines = [f"{path}: {kind} data fails {sum(not r.success for r in result.results)} expectation(s):"]
        for r in result.results:
            if not r.success:
                cfg = r.expectation_config
                info = r.result or {}
                sample = info.get("partial_unexpected_list") or info.get("observed_value")
                lines.append(f"  {cfg.type} {({k: v for k, v in cfg.kwargs.items() if k != 'batch_id'})}: "
                             f"{info.get('unexpected_count', '')} unexpected; e.g. {str(sample)[:120]}")
        raise DataValidationError("\n".join(lines))
    return table.num_rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", required=True, choices=sorted(DATASETS), help="which dataset's suite to apply")
    parser.add_argument("file", type=Path, help="Parquet file to validate")
    parser.add_argument("--allow-empty", action="store_true",
                        help="a file with no row passes (the benchmark answers of a stage before "
                        "evaluate.whole_from_stage when evaluate.early_agents is [])")


def run(args: argparse.Namespace) -> int:
    try:
        rows = validate_file(args.file, args.kind, args.allow_empty)
    except DataValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.file}: {rows} rows pass the {args.kind} suite ({len(suite(DATASETS[args.kind]))} expectations)")
    return 0
