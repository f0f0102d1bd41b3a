"""The optimal solver (CBS with its improvements: conflict priorities, heuristics, rectangle reasoning, bypasses,
joint low-level search; version 1 kept for the files drawn with it) and the reference planners."""
