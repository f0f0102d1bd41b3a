import io

from pipeline.progress import Progress, quiet, trainer_progress


def test_a_line_ends_with_the_note_once_one_is_set():
    out = io.StringIO()
    progress = Progress(4, "train (warm start)", "steps", every=0.0, stream=out)
    progress.update(1)
    progress.note = "loss 0.412"
    progress.update(1)
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("train (warm start): 1/4 steps (25%)") and "loss" not in lines[0]
    assert lines[1].startswith("train (warm start): 2/4 steps (50%)") and lines[1].endswith("; loss 0.412")
    assert lines[-1].startswith("train (warm start): 2/4 steps") and lines[-1].endswith("; loss 0.412")


def test_the_trainer_callback_reports_the_last_loss_and_reward_and_quiet_drops_the_printer(tmp_path, capsys):
    """A real transformers Trainer without a bar (``disable_tqdm``) prints every log as a dictionary; ``quiet`` removes
    that printer, and the progress lines carry the last logged loss instead."""
    import torch
    from transformers import PrinterCallback, Trainer, TrainingArguments

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def forward(self, x, y):
            return {"loss": torch.nn.functional.mse_loss(self.w(x).squeeze(-1), y)}

    data = [{"x": torch.tensor([float(i), 1.0]), "y": torch.tensor(2.0 * i)} for i in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                             disable_tqdm=True, report_to="none", use_cpu=True, save_strategy="no")
    callback = trainer_progress("train (test)", every=0.0)
    trainer = Trainer(model=Regression(), args=args, train_dataset=data, callbacks=[callback])
    assert any(isinstance(c, PrinterCallback) for c in trainer.callback_handler.callbacks)
    assert quiet(trainer) is trainer
    assert not any(isinstance(c, PrinterCallback) for c in trainer.callback_handler.callbacks)
    trainer.train()
    captured = capsys.readouterr()
    assert "{'loss'" not in captured.out + captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("train (test): ")]
    assert lines[-1].startswith("train (test): 3/3 steps (100%)")
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and lines[-1].endswith(f"; loss {logged[-1]:.4g}")
