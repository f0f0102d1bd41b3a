"""Prefect flows: :mod:`flows.curriculum` runs the DVC pipeline's stages as Prefect tasks (the stage list comes from
``dvc.yaml`` through DVC). Flows stay thin: each task runs one ``dvc repro --single-item`` of a stage; the steps
themselves never import Prefect."""
