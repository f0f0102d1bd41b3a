"""MAPF-FrozenLake: multi-agent path finding on FrozenLake grids, the testbed of env-engineer.

Subpackages, each importing only those listed before it (and ``formats`` the generator, whose draws it writes):

- :mod:`envgen.core`: grids and instances (immutable levels), the environment configuration the engineer writes
  (:mod:`envgen.core.config`), the plan checker and scorer (:mod:`envgen.core.simulate`), renderings, bounded
  file readers;
- :mod:`envgen.solver`: the optimal CBS solver (:mod:`envgen.solver.cbs`) and the reference planners;
- :mod:`envgen.llm`: the prompt, the answer parser, the reward (a TRL reward function) and the outcome rates;
- :mod:`envgen.formats`: the instances and trajectories datasets (Parquet) and their schemas, MovingAI files.

Beside them: :mod:`envgen.generator` (instances drawn from a configuration, each solved), :mod:`envgen.benchmark`
(the fixed multi-agent benchmark), :mod:`envgen.gym_env` (a Gymnasium environment) and :mod:`envgen.commands` (the
testbed's commands). None of them imports torch, Prefect, DVC or polars.
"""
