"""The instances Parquet file: schema, writer and reader.

One row per instance; the file's metadata holds the configuration YAML (``env_config``) and the generator version, so
a file says how to regenerate itself. The writer is deterministic: the same configuration, seed and library versions
give byte-identical files (no timestamps, no timings). Columns (:data:`INSTANCE_COLUMNS` is the source of truth):
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from envgen.config import EnvConfig
from envgen.files import atomic_write_bytes
from envgen.generator import GENERATOR_VERSION, Generated
from envgen.instance import Instance
from envgen.simulate import paths_to_moves

_LIST_I16 = pa.list_(pa.int16())
INSTANCE_COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("index", pa.int32(), "Position of the instance in the stage (its slot), 0-based."),
    ("instance_id", pa.string(), "Stable id: 'i' + the first 16 hex digits of the content hash."),
    ("content_hash", pa.string(), "SHA-256 of the canonical instance text (Instance.content_hash)."),
    ("instance", pa.string(), "Canonical text form; Instance.from_str(instance) rebuilds it exactly."),
    ("size", pa.int16(), "Grid side N (the grid is N x N)."),
    ("num_agents", pa.int16(), "Number of agents."),
    ("starts", pa.list_(_LIST_I16), "Start cell [row, col] per agent."),
    ("goals", pa.list_(_LIST_I16), "Goal cell [row, col] per agent."),
    ("hole_count", pa.int16(), "Number of holes."),
    ("hole_ratio", pa.float32(), "hole_count / (N * N)."),
    ("free_cells", pa.int16(), "Number of frozen (walkable) cells."),
    ("wait_target", pa.bool_(), "Whether the slot asked for an instance that needs coordination."),
    ("needs_wait", pa.bool_(), "Whether the optimum needs a wait or detour (optimal_soc > sum_shortest); equals wait_target."),
    ("optimal_soc", pa.int32(), "Optimal sum of costs (CBS, verified by the simulator)."),
    ("makespan", pa.int32(), "Makespan of the stored optimal plan."),
    ("shortest_lengths", pa.list_(pa.int32()), "Each agent's shortest path length alone on the grid."),
    ("sum_shortest", pa.int32(), "Sum of shortest_lengths: the sum of costs if agents ignored each other."),
    ("soc_gap", pa.int32(), "optimal_soc - sum_shortest: the price of coordination (difficulty feature)."),
    ("optimal_plan", pa.list_(pa.string()), "Per agent its optimal moves, space-separated words (UP/DOWN/LEFT/RIGHT/WAIT)."),
    ("solver_nodes", pa.int32(), "Search nodes the solver expanded (difficulty feature)."),
    ("solver_method", pa.string(), "'cbs' or 'joint' (exhaustive joint A*, for hard 2-agent boards)."),
    ("attempts", pa.int32(), "Draws needed to fill the slot (rejection sampling)."),
    ("seed", pa.int64(), "The configuration's seed."),
    ("draw_seed", pa.uint64(), "Seed of the slot's random stream: blake2b of 'seed:index' (generator.draw_seed)."),
    ("generator_version", pa.string(), "Version of the generator that drew the instance."),
]
INSTANCE_SCHEMA = pa.schema([pa.field(name, kind, metadata={"description": doc}) for name, kind, doc in INSTANCE_COLUMNS])

__doc__ = (__doc__ or "") + "\n" + "\n".join(f"- ``{n}`` ({t}): {d}" for n, t, d in INSTANCE_COLUMNS)


def record_of(g: Generated, seed: int) -> dict:
    """One Parquet row for a generated instance."""
    inst, sol = g.instance, g.solution
    n = inst.height
    holes = inst.hole_count
    return {
        "index": g.slot.index,
        "instance_id": "i" + inst.content_hash[:16],
        "content_hash": inst.content_hash,
        "instance": inst.to_str(),
        "size": n,
        "num_agents": inst.num_agents,
        "starts": [list(c) for c in inst.starts],
        "goals": [list(c) for c in inst.goals],
        "hole_count": holes,
        "hole_ratio": holes / (n * inst.width),
        "free_cells": n * inst.width - holes,
        "wait_target": g.slot.needs_wait,
        "needs_wait": sol.needs_wait,
        "optimal_soc": sol.soc,
        "makespan": sol.makespan,
        "shortest_lengths": list(sol.shortest),
        "sum_shortest": sol.sum_shortest,
        "soc_gap": sol.soc - sol.sum_shortest,
        "optimal_plan": [" ".join(m.value for m in moves) for moves in paths_to_moves(sol.paths)],
        "solver_nodes": sol.nodes,
        "solver_method": sol.method,
        "attempts": g.attempts,
        "seed": seed,
        "draw_seed": g.draw_seed,
        "generator_version": GENERATOR_VERSION,
    }


def write_instances(path: str | Path, generated: Iterable[Generated], config: EnvConfig) -> int:
    """Write the instances Parquet atomically; returns the row count."""
    rows = [record_of(g, config.seed) for g in generated]
    table = pa.Table.from_pylist(rows, schema=INSTANCE_SCHEMA).replace_schema_metadata(
        {"env_config": config.to_yaml(), "generator_version": GENERATOR_VERSION}
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=max(1, len(rows)))
    atomic_write_bytes(path, buf.getvalue())
    return len(rows)


def read_instances(path: str | Path) -> pa.Table:
    """Read an instances file, checking that it has this schema's columns."""
    table = pq.read_table(path)
    missing = [n for n, _, _ in INSTANCE_COLUMNS if n not in table.column_names]
    if missing:
        raise ValueError(f"{path}: not an instances file, missing columns {missing}")
    return table


def instances_of(table: pa.Table) -> list[Instance]:
    """The :class:`Instance` of every row."""
    return [Instance.from_str(text) for text in table.column("instance").to_pylist()]


def config_of(path: str | Path) -> EnvConfig:
    """The configuration stored in an instances file's metadata."""
    meta = pq.read_schema(path).metadata or {}
    if b"env_config" not in meta:
        raise ValueError(f"{path}: no env_config in the file metadata")
    return EnvConfig.from_yaml(meta[b"env_config"].decode(), f"{path}#env_config")
