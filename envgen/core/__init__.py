"""The testbed's core: grids and instances (immutable levels), the environment configuration the engineer writes,
the plan checker and scorer, renderings (ASCII, PNG), and the bounded readers every input goes through."""
