"""Pipeline steps: plain functions with a thin CLI (``env-engineer <step>``); no Prefect or DVC imports."""
