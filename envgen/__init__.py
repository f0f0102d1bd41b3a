"""MAPF-FrozenLake: multi-agent path finding on FrozenLake grids, the testbed of env-engineer.

Modules: :mod:`envgen.config` (the engineer's YAML), :mod:`envgen.instance` (immutable levels), :mod:`envgen.cbs`
(optimal solver), :mod:`envgen.simulate` (plan checker and scorer), :mod:`envgen.generator` and
:mod:`envgen.dataset` (instances Parquet), :mod:`envgen.render`, :mod:`envgen.movingai`, :mod:`envgen.gym_env`.
None of them imports Prefect, DVC or polars.
"""
