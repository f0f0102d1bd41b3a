"""Data validation with great-expectations: one expectation suite per dataset kind, run between pipeline steps.

``env-engineer validate --kind instances|trajectories|completions FILE`` exits 1 with one line per failed expectation (column,
expectation, a few offending values), so a corrupted or inconsistent Parquet stops the pipeline with a clear message.
great-expectations is imported only here (about 6 s); the step modules do not need it, so they also run where it is
not installed (the GPU image), and the pipeline runs this check as its own step.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from envgen.parse import ParseError
from envgen.simulate import FailureCategory


@dataclass(frozen=True)
class Rule:
    """One expectation: ``kind`` is a great-expectations expectation class name, ``args`` its arguments."""

    kind: str
    args: dict


def _not_null(*columns: str) -> list[Rule]:
    return [Rule("ExpectColumnValuesToNotBeNull", {"column": c}) for c in columns]


def _between(column: str, lo: float | None, hi: float | None, mostly: float = 1.0) -> Rule:
    return Rule("ExpectColumnValuesToBeBetween", {"column": column, "min_value": lo, "max_value": hi, "mostly": mostly})


SUITES: dict[str, list[Rule]] = {
    "instances": [
        Rule("ExpectTableRowCountToBeBetween", {"min_value": 1}),
        *_not_null("index", "instance_id", "content_hash", "instance", "size", "num_agents", "optimal_soc", "makespan",
                   "sum_shortest", "soc_gap", "needs_wait", "wait_target", "seed", "draw_seed", "generator_version"),
        Rule("ExpectColumnValuesToBeUnique", {"column": "content_hash"}),
        Rule("ExpectColumnValuesToBeUnique", {"column": "index"}),
        _between("size", 3, 16),
        _between("num_agents", 1, 8),
        _between("hole_ratio", 0.0, 0.5),
        _between("optimal_soc", 0, None),
        _between("soc_gap", 0, None),
        Rule("ExpectColumnPairValuesAToBeGreaterThanB", {"column_A": "optimal_soc", "column_B": "sum_shortest", "or_equal": True}),
        Rule("ExpectColumnPairValuesToBeEqual", {"column_A": "needs_wait", "column_B": "wait_target"}),
        Rule("ExpectColumnValuesToMatchRegex", {"column": "content_hash", "regex": "^[0-9a-f]{64}$"}),
    ],
    "trajectories": [
        Rule("ExpectTableRowCountToBeBetween", {"min_value": 1}),
        *_not_null("instance_id", "content_hash", "stage", "sample_index", "completion", "reward", "parsed", "valid",
                   "optimal", "optimal_soc", "model_id", "seed"),
        _between("sample_index", 0, None),
        _between("reward", -10.0, 10.0),
        _between("completion_tokens", 0, None),
        Rule("ExpectColumnValuesToBeInSet", {"column": "failure_category", "value_set": [c.value for c in FailureCategory]}),
        Rule("ExpectColumnValuesToBeInSet", {"column": "parse_error", "value_set": [e.value for e in ParseError]}),
        Rule("ExpectColumnValuesToMatchRegex", {"column": "content_hash", "regex": "^[0-9a-f]{64}$"}),
    ],
    "completions": [  # may be empty: a stage without GRPO writes no completions
        *_not_null("step", "instance_id", "size", "completion", "reward", "parsed", "valid", "optimal"),
        _between("step", 0, None),
        _between("reward", -10.0, 10.0),
        Rule("ExpectColumnValuesToBeInSet", {"column": "failure_category", "value_set": [c.value for c in FailureCategory]}),
        Rule("ExpectColumnValuesToBeInSet", {"column": "parse_error", "value_set": [e.value for e in ParseError]}),
    ],
}
"""Expectations per dataset kind (columns holding lists are checked by the writers' schemas instead)."""


class DataValidationError(RuntimeError):
    """The file breaks its suite; the message lists each failed expectation."""


def validate_file(path: str | Path, kind: str) -> int:
    """Validate a Parquet file against the suite of ``kind``; returns the row count or raises."""
    if kind not in SUITES:
        raise ValueError(f"kind {kind!r}: choose one of {sorted(SUITES)}")
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - any reader failure is a corrupt or missing file
        raise DataValidationError(f"{path}: cannot be read as Parquet ({type(e).__name__}: {e})") from None
    needed = sorted({c for rule in SUITES[kind] for k, c in rule.args.items() if k in ("column", "column_A", "column_B")})
    missing = [c for c in needed if c not in table.column_names]
    if missing:
        raise DataValidationError(f"{path}: not a {kind} file: missing columns {missing}")
    frame = table.select(needed).to_pandas()

    import great_expectations as gx

    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (context.data_sources.add_pandas("env_engineer").add_dataframe_asset(kind)
             .add_batch_definition_whole_dataframe("all").get_batch(batch_parameters={"dataframe": frame}))
    suite = gx.ExpectationSuite(name=f"{kind}_suite")
    for rule in SUITES[kind]:
        suite.add_expectation(getattr(gx.expectations, rule.kind)(**rule.args))
    result = batch.validate(suite, result_format="SUMMARY")
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
    parser.add_argument("--kind", required=True, choices=sorted(SUITES), help="which suite to apply")
    parser.add_argument("file", type=Path, help="Parquet file to validate")


def run(args: argparse.Namespace) -> int:
    try:
        rows = validate_file(args.file, args.kind)
    except DataValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.file}: {rows} rows pass the {args.kind} suite ({len(SUITES[args.kind])} expectations)")
    return 0
