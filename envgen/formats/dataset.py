"""The instances Parquet file: generation with verification, writer and reader.

One row per instance; the file's metadata holds the configuration YAML (``env_config``), the generator version, and
what the draws came to (``generator_stats``: draws accepted and rejected by reason, over solver budget among them, per
size, and the solver budget; :func:`envgen.generator.draw_statistics`), so a file says how to regenerate itself and
what was left out. Every instance's optimal plan is replayed through the simulator before it is
written (:func:`verify`: its validity and its SoC must match the solver's), so the ground truth is checked twice by
independent code. The writer is deterministic: the same configuration, seed and library versions give byte-identical
files (no timestamps, no timings). Columns (:data:`envgen.formats.schemas.INSTANCES` is the source of truth):
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from envgen.core.config import EnvConfig
from envgen.core.files import atomic_write_bytes
from envgen.generator import Generated, GeneratorOptions, draw_statistics, generate
from envgen.core.instance import Instance, InstanceError
from envgen.formats.schemas import INSTANCES, Dataset
from envgen.core.simulate import Valid, check_paths, paths_to_moves

__doc__ = (__doc__ or "") + "\n" + "\n".join(f"- ``{c.name}`` ({c.type}): {c.description}" for c in INSTANCES.columns)


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
        "generator_version": g.version,
    }


class VerificationError(RuntimeError):
    """The simulator disagreed with the solver: a bug, never a property of the data."""


def verify(g: Generated) -> None:
    """Replay the solver's plan through the simulator; raise :class:`VerificationError` on any disagreement."""
    result = check_paths(g.instance, g.solution.paths, g.solution.soc)
    if not isinstance(result, Valid) or not result.optimal or result.makespan != g.solution.makespan:
        raise VerificationError(f"slot {g.slot.index}: the simulator rejects the solver's plan ({result}) for\n{g.instance.to_str()}")


def generate_verified(config: EnvConfig, options: GeneratorOptions | None = None, exclude: Iterable[str] = (),
                      on_progress: Callable[[int], None] | None = None) -> Iterator[Generated]:
    """:func:`envgen.generator.generate`, every instance verified by the simulator (:func:`verify`) as it comes."""
    for g in generate(config, options, exclude, on_progress=on_progress):
        verify(g)
        yield g


def write_dataset(path: str | Path, rows: Sequence[dict[str, Any]], dataset: Dataset,
                  metadata: dict[str, str] | None = None, row_group_size: int | None = None) -> int:
    """Write ``rows`` as ``dataset``'s Parquet file (its schema, zstd), atomically; returns the row count."""
    table = pa.Table.from_pylist(list(rows), schema=dataset.schema)
    if metadata is not None:
        table = table.replace_schema_metadata(metadata)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=row_group_size)
    atomic_write_bytes(path, buf.getvalue())
    return table.num_rows


def write_instances(path: str | Path, generated: Iterable[Generated], config: EnvConfig,
                    options: GeneratorOptions | None = None) -> int:
    """Write the instances Parquet atomically (``options``: those the instances were generated with, for the file's
    generator version and ``generator_stats``; version 1 files have no ``generator_stats``, as when that version was
    current); returns the row count."""
    options = options or GeneratorOptions()
    generated = list(generated)
    rows = [record_of(g, config.seed) for g in generated]
    meta = {"env_config": config.to_yaml(), "generator_version": options.version_name}
    if options.version > 1:
        meta["generator_stats"] = json.dumps(draw_statistics(generated, options), sort_keys=True)
    return write_dataset(path, rows, INSTANCES, meta, row_group_size=max(1, len(rows)))


def generator_stats_of(path: str | Path) -> dict[str, Any]:
    """The draw statistics stored in an instances or benchmark file's metadata (``generator_stats``)."""
    meta = pq.read_schema(path).metadata or {}
    if b"generator_stats" not in meta:
        raise ValueError(f"{path}: no generator_stats in the file metadata")
    return json.loads(meta[b"generator_stats"])


MAX_PARQUET_BYTES = 2_000_000_000
"""Largest Parquet file read (the largest the project writes, the starting policy's 50,000 instances, is 5 MB)."""

MAX_INSTANCE_CHARS = 20_000
"""Longest instance text parsed (a 16 x 16 board with 8 agents takes under 1,000 characters)."""


def read_parquet(path: str | Path, what: str, columns: list[str] | None = None, dataset: Dataset | None = None) -> pa.Table:
    """A Parquet file as a table, within bounds: a missing, empty, truncated or non-Parquet file, a device or FIFO, a
    file over :data:`MAX_PARQUET_BYTES`, or one without ``columns``, is one ``ValueError`` naming the file. With
    ``dataset``, the columns read are cast to its types (a column of text where it says booleans is refused, named)."""
    import stat

    path = Path(path)
    try:
        info = path.stat()
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or type(e).__name__}); give the {what}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file (a folder, device or FIFO); give the {what}")
    if info.st_size > MAX_PARQUET_BYTES:
        raise ValueError(f"{path}: {info.st_size:,} bytes, more than the {MAX_PARQUET_BYTES:,} read; give the {what}")
    try:
        names = pq.read_schema(path).names
    except (OSError, ValueError) as e:  # pyarrow: ArrowInvalid (a ValueError) for a file that is not Parquet
        raise ValueError(f"{path}: not a Parquet file ({str(e).splitlines()[0][:120]}); give the {what}") from None
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise ValueError(f"{path}: not {what}: no column {', '.join(missing[:5])}")
    try:
        table = pq.read_table(path, columns=columns)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as {what} ({str(e).splitlines()[0][:120]})") from None
    if dataset is not None:
        for name in table.column_names:
            if name not in dataset.names:
                continue
            want = dataset.column(name).type
            if table.schema.field(name).type != want:
                try:
                    table = table.set_column(table.column_names.index(name), name, table.column(name).cast(want))
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
                    raise ValueError(f"{path}: column {name} holds {table.schema.field(name).type}, not {want}; "
                                     f"is it {what}?") from None
    return table


def read_instances(path: str | Path) -> pa.Table:
    """Read an instances file, checking that it has this schema's columns and that its ``instance`` column holds text
    (:func:`parse_instances` parses it)."""
    table = read_parquet(path, "an instances file", None)
    missing = [n for n in INSTANCES.names if n not in table.column_names]
    if missing:
        raise ValueError(f"{path}: not an instances file, missing columns {missing}")
    if not pa.types.is_string(table.schema.field("instance").type) and not pa.types.is_large_string(
            table.schema.field("instance").type):
        raise ValueError(f"{path}: its instance column holds {table.schema.field('instance').type}, not text")
    return table


def parse_instances(texts: Iterable[Any], source: str | Path) -> list[Instance]:
    """The :class:`Instance` of each text, or a ``ValueError`` naming ``source``, the row and what is wrong (a null or
    non-text cell, an oversized text, a malformed one), never quoting more than a few characters of it."""
    out = []
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"{source}: row {row}: the instance is {type(text).__name__}, not text")
        if len(text) > MAX_INSTANCE_CHARS:
            raise ValueError(f"{source}: row {row}: an instance of {len(text):,} characters (at most "
                             f"{MAX_INSTANCE_CHARS:,})")
        try:
            out.append(Instance.from_str(text))
        except InstanceError as e:
            raise ValueError(f"{source}: row {row}: not an instance ({str(e)[:160]})") from None
    return out


def read_exclusions(paths: Iterable[str | Path]) -> frozenset[str]:
    """Content hashes of the instances in ``paths`` (instances files): instances that must not be generated again,
    such as the validation set's and the benchmark's."""
    hashes: set[str] = set()
    for p in paths:
        try:
            hashes.update(pq.read_table(p, columns=["content_hash"]).column("content_hash").to_pylist())
        except (OSError, ValueError, KeyError) as e:  # pyarrow's errors are OSError / ValueError subclasses
            raise ValueError(f"{p}: not an instances Parquet file with a content_hash column ({str(e)[:160]})") from None
    return frozenset(hashes)


def instances_of(table: pa.Table, source: str | Path = "<table>") -> list[Instance]:
    """The :class:`Instance` of every row (:func:`parse_instances`)."""
    return parse_instances(table.column("instance").to_pylist(), source)


def config_of(path: str | Path) -> EnvConfig:
    """The configuration stored in an instances file's metadata."""
    meta = pq.read_schema(path).metadata or {}
    if b"env_config" not in meta:
        raise ValueError(f"{path}: no env_config in the file metadata")
    return EnvConfig.from_yaml(meta[b"env_config"].decode(), f"{path}#env_config")
