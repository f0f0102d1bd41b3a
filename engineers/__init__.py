"""The environment engineers: who writes the next stage's configuration, from what, and how a proposal becomes one.

- :mod:`engineers.summary`: :class:`~engineers.summary.Summary`, the typed stage summary an engineer reads (written by
  the ``summarize-failures`` step) and its text sections;
- :mod:`engineers.proposal`: :class:`~engineers.proposal.Proposal` (untrusted per-size knobs), the
  :class:`~engineers.proposal.Engineer` contract, and :func:`~engineers.proposal.finalize`, which turns any proposal
  into a valid configuration;
- :mod:`engineers.baselines`: ``fixed``, ``random`` and ``heuristic``;
- :mod:`engineers.llm`: the LLM engineer, its prompt and the context variants of the paper's ablation;
- :mod:`engineers.registry`: :data:`~engineers.registry.ENGINEERS`, every engineer's factory by name.
"""
