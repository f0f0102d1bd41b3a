"""What the pipeline's steps share: the typed ``params.yaml`` (:mod:`pipeline.params`: every section, one loader, one
override syntax) and the great-expectations checks of every Parquet dataset (:mod:`pipeline.checks`, derived from
:mod:`envgen.formats.schemas`). ``dvc.yaml`` is the pipeline itself and the one place that names paths."""
