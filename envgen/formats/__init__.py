"""Files: the instances and trajectories datasets (Parquet) and their schemas, and MovingAI maps and scenarios."""
