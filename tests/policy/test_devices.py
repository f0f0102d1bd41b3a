import os
import subprocess
import sys
import time

import pytest

from policy import devices

CLAIM = ("import os, sys, time; from policy.devices import claim_gpu; gpu = claim_gpu(poll_seconds=0.1); "
         "print(gpu, os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(float(sys.argv[1]))")


def start(env: dict[str, str], hold: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLAIM, str(hold)], env=env, stdout=subprocess.PIPE, text=True)


def test_processes_claim_distinct_gpus_of_the_pool_and_wait_for_a_free_one(tmp_path):
    env = {**os.environ, "ENV_ENGINEER_GPUS": "0,1", "ENV_ENGINEER_GPU_LOCKS": str(tmp_path)}
    first, second = start(env, 2.0), start(env, 2.0)
    claimed = sorted(p.stdout.readline().split()[0] for p in (first, second))
    assert claimed == ["0", "1"]  # one GPU each, and each sees only its own
    began = time.monotonic()
    third = start(env, 0.0)
    line = third.stdout.readline().split()
    assert line[0] in ("0", "1") and line[1] == line[0] and time.monotonic() - began > 0.5  # it waited for one to end
    for p in (first, second, third):
        p.wait(timeout=30)


def test_slots_let_several_processes_share_a_gpu(tmp_path):
    env = {**os.environ, "ENV_ENGINEER_GPUS": "3", "ENV_ENGINEER_GPU_SLOTS": "2", "ENV_ENGINEER_GPU_LOCKS": str(tmp_path)}
    procs = [start(env, 1.0) for _ in range(2)]
    assert [p.stdout.readline().split()[0] for p in procs] == ["3", "3"]
    for p in procs:
        p.wait(timeout=30)


def test_no_pool_changes_nothing_and_bad_settings_are_explained(monkeypatch):
    monkeypatch.delenv("ENV_ENGINEER_GPUS", raising=False)
    monkeypatch.setattr(devices, "_claimed", None)
    assert devices.claim_gpu() is None
    monkeypatch.setenv("ENV_ENGINEER_GPUS", "0,x")
    with pytest.raises(ValueError, match="GPU indices"):
        devices.claim_gpu()
    monkeypatch.setenv("ENV_ENGINEER_GPUS", "0")
    monkeypatch.setenv("ENV_ENGINEER_GPU_SLOTS", "0")
    with pytest.raises(ValueError, match="at least 1"):
        devices.claim_gpu()


def test_slots_fill_every_gpu_before_doubling_up(tmp_path):
    """With two GPUs of two slots, the first two processes get one GPU each (not both the first GPU)."""
    env = {**os.environ, "ENV_ENGINEER_GPUS": "0,1", "ENV_ENGINEER_GPU_SLOTS": "2", "ENV_ENGINEER_GPU_LOCKS": str(tmp_path)}
    first = start(env, 1.0)
    a = first.stdout.readline().split()[0]
    second = start(env, 1.0)
    b = second.stdout.readline().split()[0]
    assert {a, b} == {"0", "1"}
    for p in (first, second):
        p.wait(timeout=30)


def test_without_a_pool_a_process_keeps_only_the_first_visible_gpu(monkeypatch, capsys):
    monkeypatch.delenv("ENV_ENGINEER_GPUS", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(devices, "_claimed", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert devices.claim_gpu() is None and os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    assert "using GPU 2 of 2,3" in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a distributed launch: each process is given its GPU
    assert devices.only_the_first_gpu() is None and os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


ORDER = ("import os, time; from policy.devices import claim_gpu_after; seen = []; "
         "gpu = claim_gpu_after(lambda: seen.append((os.environ.get('CUDA_VISIBLE_DEVICES'), time.monotonic())), "
         "poll_seconds=0.1); print(gpu, seen[0][0], round(time.monotonic() - seen[0][1], 2), flush=True)")


def test_a_pool_of_one_gpu_prepares_before_the_slot_is_free_and_a_pool_of_several_after(tmp_path):
    """One GPU: ``prepare`` runs (seeing that GPU, its only one) while another process holds the only slot, and the
    claim follows once the slot is free; several GPUs: the claim comes first, so ``prepare`` sees the claimed GPU."""
    env = {**os.environ, "ENV_ENGINEER_GPUS": "3", "ENV_ENGINEER_GPU_LOCKS": str(tmp_path), "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    holder = start(env, 1.5)
    assert holder.stdout.readline().split()[0] == "3"
    waiter = subprocess.run([sys.executable, "-c", ORDER], env=env, capture_output=True, text=True, timeout=60)
    gpu, seen, waited = waiter.stdout.split()
    assert (gpu, seen) == ("3", "3") and float(waited) > 0.3, waiter.stderr  # prepared, then waited for the slot
    holder.wait(timeout=30)
    env = {**env, "ENV_ENGINEER_GPUS": "0,1"}
    gpu, seen, _ = subprocess.run([sys.executable, "-c", ORDER], env=env, capture_output=True, text=True,
                                  timeout=60).stdout.split()
    assert gpu in ("0", "1") and seen == gpu
