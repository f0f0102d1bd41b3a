"""Prefect flows that chain the pipeline steps per curriculum stage (the pipeline issue adds them).

Flows stay thin: each Prefect task runs one step of :mod:`tasks`; the steps themselves never import Prefect.
"""
