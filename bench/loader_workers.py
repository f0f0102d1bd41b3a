"""What a warm start's data loader costs the CPU: one stage's batches collated in the training process, by workers
forked from it, and by workers spawned (what a process started by ``spawn``, as a warm trainer is, gets by default).

    python bench/loader_workers.py --examples 1000 --batch 16 --workers 2 --repeats 3

Builds TRL's ``SFTTrainer`` as ``steps.train.warm_start`` does (completion-only loss, padding-free rows, the
preset's prompt) on the embedded model, over ``--examples`` two-agent demonstrations of the shipped start's
instances, and reads its whole training data loader once per way and repeat. Prints for each: wall seconds, this
process's CPU seconds and its workers' (reaped children), then the medians and the same-run ratio of the workers'
CPU, spawned against forked. On the CPU, so the collation is the same as on a GPU machine but not the training.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="presets/gpu-distill.yaml", help="the preset whose prompt style is used")
    parser.add_argument("--examples", type=int, default=1000, help="demonstrations in the stage")
    parser.add_argument("--batch", type=int, default=16, help="demonstrations a batch")
    parser.add_argument("--workers", type=int, default=2, help="loader workers for the forked and spawned ways")
    parser.add_argument("--repeats", type=int, default=3, help="reads of the loader per way")
    args = parser.parse_args()

    import polars as pl
    import pyarrow.compute as pc
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from pipeline.params import load_params
    from policy.accel.packed_attention import FixedSegments
    from policy.models import load_model
    from steps.train import demonstrations

    style = load_params(args.params).policy.prompt
    rows = (pl.read_parquet("data/start/instances.parquet").filter(pl.col("num_agents") == 2)
            .sample(args.examples, seed=0).to_dicts())
    dataset = Dataset.from_list(demonstrations(rows, style))
    loaded = load_model("embedded", device="cpu")
    tok, model = loaded.tokenizer, loaded.model
    ways = {"in the process": (0, None), "forked workers": (args.workers, "fork"),
            "spawned workers": (args.workers, "spawn")}
    seen: dict[str, list[tuple[float, float, float]]] = {way: [] for way in ways}
    for repeat in range(args.repeats):
        for way, (workers, context) in ways.items():
            config = SFTConfig(output_dir="/tmp/loader-workers-bench", report_to="none", use_cpu=True,
                               per_device_train_batch_size=args.batch, completion_only_loss=True, padding_free=True,
                               max_length=None, dataloader_num_workers=workers,
                               dataloader_multiprocessing_context=context, disable_tqdm=True)
            trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok)
            longest = pc.max(pc.list_value_length(trainer.train_dataset.data.column("input_ids"))).as_py()
            trainer.data_collator = FixedSegments(trainer.data_collator, longest)
            wall, own, kids = time.perf_counter(), time.process_time(), children_cpu()
            batches = sum(1 for _ in trainer.get_train_dataloader())
            row = (time.perf_counter() - wall, time.process_time() - own, children_cpu() - kids)
            seen[way].append(row)
            print(f"repeat {repeat} {way:16s} {batches} batches: wall {row[0]:.2f} s, this process {row[1]:.2f} "
                  f"CPU s, workers {row[2]:.2f} CPU s", flush=True)
    medians = {way: [statistics.median(r[i] for r in rows) for i in range(3)] for way, rows in seen.items()}
    for way, (wall, own, kids) in medians.items():
        print(f"median {way:16s} wall {wall:.2f} s, this process {own:.2f} CPU s, workers {kids:.2f} CPU s")
    fork, spawn = medians["forked workers"][2], medians["spawned workers"][2]
    print(f"workers' CPU, spawned / forked: {spawn / fork:.1f}" if fork > 0 else "forked workers used no CPU")


if __name__ == "__main__":
    main()
