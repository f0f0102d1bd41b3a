"""The pipeline's steps: one module per ``dvc.yaml`` stage.

Each holds a pure function (typed inputs: settings from :mod:`pipeline.params` and input paths, to outputs) and a thin
command line (``add_arguments``, ``run``, ``main``) that ``dvc.yaml`` calls as ``env-engineer <step>``. No step
imports another step; what they share lives in :mod:`envgen`, :mod:`policy`, :mod:`engineers` and :mod:`pipeline`.

- ``validation-set`` (:mod:`steps.validation_set`), ``build-benchmark`` (:mod:`steps.build_benchmark`),
  ``init-curriculum`` (:mod:`steps.init_curriculum`): once per pipeline;
- per curriculum stage: ``generate-instances`` -> ``train`` -> ``rollout`` of the validation set (the ``validate@K``
  stage) and ``evaluate`` of the benchmark (``evaluate@K``, after its own ``rollout``) -> ``summarize-failures`` ->
  ``engineer-config`` (the next stage's configuration).
"""
