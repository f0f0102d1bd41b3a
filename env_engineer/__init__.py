"""The ``env-engineer`` command (:mod:`env_engineer.cli`): every pipeline step, the testbed's commands, the
experiments and the server under one name. ``python -m env_engineer`` is the same."""
