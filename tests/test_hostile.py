"""The hostile-input corpus (tests/hostile/) through every surface: one clear line, exit 2 (or a 4xx), never a traceback,
an echo of the input, a hung server or a leaked API key."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from env_engineer.cli import main

CORPUS = Path(__file__).resolve().parent / "hostile"
GOOD_CONFIG = "num_agents: 2\nbudget: 4\nseed: 0\nsizes: {3: {data_ratio: 1}}\n"
KEY = "sk-test-0123456789abcdef"
MOVINGAI = CORPUS / "movingai"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_clear_error(code: int, err: str, expected: int = 2) -> None:
    assert code == expected, err[-500:]
    assert err.startswith("error:") and len(err) < 2000 and "Traceback" not in err, err[:500]


def configs() -> list[Path]:
    return sorted((CORPUS / "configs").iterdir())


@pytest.fixture(scope="module")
def huge_value(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("huge") / "20mb.yaml"
    path.write_text(GOOD_CONFIG + "note: \"" + "A" * 20_000_000 + "\"\n")
    return path


@pytest.mark.parametrize("path", configs(), ids=lambda p: p.name)
def test_hostile_configurations_are_refused_in_one_line(path, capsys, tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_CONFIG)
    assert_one_clear_error(*run(capsys, "validate-config", path)[::2])
    assert_one_clear_error(*run(capsys, "diff-configs", good, path)[::2])
    assert_one_clear_error(*run(capsys, "generate-instances", "--config", path, "--out", tmp_path / "o.parquet")[::2])
    assert_one_clear_error(*run(capsys, "validation-set", "--params", path, "--out", tmp_path / "v.parquet")[::2])
    assert not (tmp_path / "o.parquet").exists() and not Path("/tmp/pwned").exists()


def test_a_huge_value_is_refused_without_being_echoed(huge_value, capsys, tmp_path):
    for argv in (("validate-config", huge_value), ("validation-set", "--params", huge_value, "--out", tmp_path / "v")):
        assert_one_clear_error(*run(capsys, *argv)[::2])


@pytest.mark.parametrize("map_name, scen_name", [
    ("arabic-height.map", "ok.scen"), ("duplicate-header.map", "ok.scen"), ("trailing-rows.map", "ok.scen"),
    ("too-wide.map", "ok.scen"),
    ("binary.map", "ok.scen"), ("ok.map", "binary.scen"), ("huge-height.map", "ok.scen"),
    ("ok.map", "huge-coordinates.scen"), ("ok.map", "negative-coordinates.scen"), ("no-header.map", "ok.scen"),
    ("wrong-width.map", "ok.scen"), ("missing.map", "ok.scen")])
def test_hostile_movingai_files_are_refused_in_one_line(map_name, scen_name, capsys, tmp_path):
    files = ["--map", MOVINGAI / map_name, "--scen", MOVINGAI / scen_name, "--agents", 2]
    assert_one_clear_error(*run(capsys, "solve", *files)[::2])
    assert_one_clear_error(*run(capsys, "render", *files)[::2])
    plan = tmp_path / "p.json"
    plan.write_text("[[[0, 0]], [[2, 0]]]")
    assert_one_clear_error(*run(capsys, "check-plan", *files, "--plan", plan)[::2])


@pytest.fixture(scope="module")
def fifo(tmp_path_factory) -> Path:
    import os

    path = tmp_path_factory.mktemp("fifo") / "input.fifo"
    os.mkfifo(path)  # nobody writes to it: opening it to read would wait for ever
    return path


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_devices_and_fifos_given_as_files_are_refused_before_they_are_read(special, fifo, capsys, tmp_path):
    """A size check by stat() sees 0 bytes in /dev/zero (which then fills memory) and a FIFO blocks its reader: every
    file input must be a regular file, refused in one line otherwise."""
    path = fifo if special == "fifo" else Path(special)
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_CONFIG)
    files = ["--map", MOVINGAI / "ok.map", "--scen", MOVINGAI / "ok.scen", "--agents", 2]
    for argv in (("validate-config", path), ("validation-set", "--params", path, "--out", tmp_path / "v"),
                 ("check-plan", *files, "--plan", path), ("solve", "--map", path, "--scen", MOVINGAI / "ok.scen",
                                                          "--agents", 2),
                 ("render", "--instance-file", path), ("render", "--instances", path),
                 ("rollout", "--params", Path(__file__).resolve().parents[1] / "params.yaml", "--instances", path,
                  "--out", tmp_path / "t.parquet")):
        code, _, err = run(capsys, *argv)
        assert_one_clear_error(code, err)
        assert "regular file" in err, (argv, err)


def test_broken_instance_cells_and_texts_are_named_with_their_file_and_row_never_echoed(capsys, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    hostile = "grid 3 3\n" + "X" * 2_000_000
    for name, cells in (("null", [None]), ("number", [7]), ("huge", [hostile]), ("garbage", ["grid 3 3\nnot a board"])):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"instance": pa.array(cells, pa.int64() if name == "number" else pa.string())}), path)
        code, _, err = run(capsys, "render", "--instances", path)
        assert_one_clear_error(code, err)
        assert str(path) in err and len(err) < 500, err[:600]
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.parquet"
    pq.write_table(pa.table({"instance": ["x"]}), truncated)
    truncated.write_bytes(truncated.read_bytes()[:40])
    for path in (empty, truncated):
        code, _, err = run(capsys, "render", "--instances", path)
        assert_one_clear_error(code, err)
        assert "not a Parquet file" in err


def plans() -> list[Path]:
    return sorted((CORPUS / "plans").iterdir())


@pytest.mark.parametrize("path", plans(), ids=lambda p: p.name)
def test_hostile_plans_exit_2_never_1(path, capsys):
    files = ["--map", MOVINGAI / "ok.map", "--scen", MOVINGAI / "ok.scen", "--agents", 2]
    assert run(capsys, "solve", *files)[0] == 0  # the instance itself is fine
    assert_one_clear_error(*run(capsys, "check-plan", *files, "--plan", path)[::2])


def test_deep_and_oversized_plans_exit_2(capsys, tmp_path):
    files = ["--map", MOVINGAI / "ok.map", "--scen", MOVINGAI / "ok.scen", "--agents", 2]
    deep, big = tmp_path / "deep.json", tmp_path / "big.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    big.write_text("[[" + ",".join(["[0, 0]"] * 1_500_000) + "], [[2, 0]]]")
    for plan in (deep, big):
        assert_one_clear_error(*run(capsys, "check-plan", *files, "--plan", plan)[::2])


def test_schema_sizes_and_excluded_files_are_checked_before_use(capsys, tmp_path):
    assert_one_clear_error(*run(capsys, "config-schema", "--sizes", "3-2000000000")[::2])
    assert_one_clear_error(*run(capsys, "config-schema", "--sizes", "9" * 5000)[::2])
    good = tmp_path / "c.yaml"
    good.write_text(GOOD_CONFIG)
    assert_one_clear_error(*run(capsys, "generate-instances", "--config", good, "--out", tmp_path / "o.parquet",
                                "--exclude", good)[::2])


def answers() -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted((CORPUS / "answers").iterdir())]


def test_every_hostile_answer_becomes_a_valid_next_configuration():
    from engineers.llm import CONTEXTS, LLMEngineer
    from engineers.summary import Summary
    from envgen.core.config import EnvConfig
    from pipeline.params import EngineerSettings, PolicySettings
    from policy.backends import Generation
    from steps.engineer_config import engineer_config

    current = EnvConfig.from_yaml("num_agents: 2\nbudget: 6\nseed: 0\nsizes: {3: {data_ratio: 1}, 4: {data_ratio: 1}}\n")

    class Scripted:
        model_id, adapter_hash = "scripted", None

        def __init__(self, text: str) -> None:
            self.text = text

        def generate(self, conversations, n, params, on_progress=None):
            return [[Generation(self.text, 1, 1, "stop", 0.0, 0)]]

    for text in [*answers(), "{ {" * 200_000, '{"a":' * 100_000]:
        engineer = LLMEngineer("base", Scripted(text), CONTEXTS["failures"], attempts=1)
        result = engineer_config(Summary(stage=0), current, EngineerSettings(engineer="base", attempts=1), PolicySettings(),
                                 0, engineer=engineer)
        config = result.config
        assert EnvConfig.parse(json.loads(config.model_dump_json())) == config
        assert config.budget == current.budget and config.num_agents == current.num_agents and config.seed == 1
        assert len(json.dumps(result.log, default=str)) < 50_000  # the log (in git) keeps an excerpt of each answer


# ------------------------------------------------------------------------------------------------------------ serve
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from policy.backends import TransformersBackend
    from policy.serve import RunningServer, ServeLimits, make_app

    backend = TransformersBackend(str(tiny_model_dir), device="cpu", batch_size=1, threads=1)
    limits = ServeLimits(max_n=64, max_tokens=2048, max_prompt_tokens=1024, timeout_s=60.0)
    running = RunningServer(make_app(backend, "tiny", None, limits))
    yield running
    running.stop()


def raw_request(url: str, body: bytes, path: str = "/v1/chat/completions", headers: dict[str, str] | None = None,
                timeout: float = 60.0) -> int:
    """Send one request on a raw socket (headers exactly as given); the status, or 0 for no reply."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    head = {"Host": "127.0.0.1", "Content-Type": "application/json", "Connection": "close", "Content-Length": str(len(body)),
            **(headers or {})}
    data = f"POST {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n" + body
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        reply = b""
        try:
            sock.sendall(data)  # a server that refuses a body early may close before it is all sent
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/") else 0


HELLO = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path", sorted((CORPUS / "http").iterdir()), ids=lambda p: p.name)
def test_hostile_requests_get_a_4xx_and_the_server_stays_up(path, server):
    spec = json.loads(path.read_text())
    status = raw_request(server.url, spec["body"].encode(), spec.get("path", "/v1/chat/completions"), spec.get("headers"))
    assert status == spec["status"]
    assert raw_request(server.url, json.dumps(HELLO).encode()) == 200


def test_oversized_bodies_prompts_and_deep_json_are_refused(server):
    import httpx

    big = json.dumps({"messages": [{"role": "user", "content": "x" * 5_000_000}]}).encode()
    assert raw_request(server.url, big) in (413, 0)  # 413 at once, before the body is read (or the reset that cuts it)
    reply = httpx.post(f"{server.url}/chat/completions", content=big[:1_000_100], timeout=60,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 413 and "at most 1,000,000 bytes" in reply.json()["error"]["message"]
    long_prompt = {"messages": [{"role": "user", "content": "U D L R " * 12_500}], "max_tokens": 4}  # ~100 KB
    reply = httpx.post(f"{server.url}/chat/completions", json=long_prompt, timeout=60)
    assert reply.status_code == 400 and "tokens" in reply.json()["error"]["message"]
    assert raw_request(server.url, b"[" * 100_000) == 400
    assert httpx.post(f"{server.url}/chat/completions", json=HELLO, timeout=60).status_code == 200


def test_an_abandoned_generation_frees_the_model(server):
    """A client that sends a long request (64 samples x 2,048 tokens) and leaves: its generation stops at the next
    token, and the next request is served at once."""
    import httpx

    body = json.dumps({**HELLO, "n": 64, "max_tokens": 2048, "temperature": 1.0}).encode()
    from urllib.parse import urlsplit

    parts = urlsplit(server.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while not httpx.get(f"{server.url[:-3]}/health").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    left = time.monotonic()
    sock.close()
    while httpx.get(f"{server.url[:-3]}/health").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    freed_after = time.monotonic() - left
    reply = httpx.post(f"{server.url}/chat/completions", json=HELLO, timeout=60)
    assert reply.status_code == 200
    assert freed_after < 10, f"the model stayed busy {freed_after:.1f} s after its client left"


def test_load_at_1_10_and_50_clients_is_served_or_told_to_retry(server):
    """A bounded load test on loopback: every request gets an answer (200, or 429 when the waiting room is full);
    none is dropped. Requests/s and latencies per level: bench/serve_load.py."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from serve_load import burst, level

    for clients in (1, 10, 50):
        row = level(server.url, clients, requests=clients * 2, max_tokens=4, timeout=60)
        assert set(row["outcomes"]) <= {"200", "429"} and row["outcomes"].get("200", 0) > 0, (clients, row)
    crowd = burst(server.url, 100, timeout=60)
    assert set(crowd["outcomes"]) <= {"200", "429"} and sum(crowd["outcomes"].values()) == 100


# --------------------------------------------------------------------------------------------------- the API key
class Recorder(BaseHTTPRequestHandler):
    """An endpoint whose behaviour the test sets: it records every request's headers."""

    behaviour: dict = {}
    seen: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).seen.append(dict(self.headers))
        b = type(self).behaviour
        status, body, headers = b.get("status", 200), b.get("body", "{}"), b.get("headers", {})
        if callable(body):
            body = body(self.headers)
        data = body.encode()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def endpoint(behaviour: dict) -> tuple[ThreadingHTTPServer, str, type]:
    handler = type("Handler", (Recorder,), {"behaviour": behaviour, "seen": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/v1", handler


def echo_key(headers) -> str:
    return json.dumps({"error": {"message": f"bad key {headers.get('Authorization')}"}})


def answer_with_key(headers) -> str:
    return json.dumps({"choices": [{"message": {"content": f"my key is {headers.get('Authorization')}"},
                                    "finish_reason": "stop"}]})


@pytest.mark.parametrize("case", ["redirect", "echo-4xx", "echo-5xx", "echo-200", "not-a-completion", "not-json"])
def test_the_api_key_never_leaves_its_host_nor_reaches_a_record(case, monkeypatch, tmp_path, capsys):
    from policy.backends import BackendError, OpenAIBackend, SamplingParams

    monkeypatch.setenv("HOSTILE_KEY", KEY)
    other, other_url, other_handler = endpoint({"body": answer_with_key})
    behaviours = {
        "redirect": {"status": 302, "headers": {"Location": other_url + "/chat/completions"}},
        "echo-4xx": {"status": 401, "body": echo_key},
        "echo-5xx": {"status": 503, "body": echo_key},
        "echo-200": {"body": answer_with_key},
        "not-a-completion": {"body": '{"choices": "x"}'},
        "not-json": {"body": "<html>" + "x" * 1000},
    }
    srv, url, handler = endpoint(behaviours[case])
    try:
        client = OpenAIBackend(url, "m", api_key_env="HOSTILE_KEY", max_retries=1, backoff_s=0.01)
        try:
            out = client.generate([[{"role": "user", "content": "hi"}]], 1, SamplingParams(stop=()))
            text = out[0][0].text
        except BackendError as e:
            text = str(e)
        assert KEY not in text
        if case == "echo-200":
            assert "***" in text  # the endpoint's echo of the key, scrubbed
        assert handler.seen and handler.seen[0].get("Authorization") == f"Bearer {KEY}"  # the key went where it belongs
        assert not other_handler.seen  # and nowhere else
        # the same endpoint as the api engineer: nothing it answers puts the key into engineer_log.json
        (tmp_path / "c.yaml").write_text(GOOD_CONFIG)
        from engineers.summary import Summary

        (tmp_path / "s.json").write_text(Summary(stage=0).to_json())
        params = tmp_path / "params.yaml"
        from tests.helpers import ROOT

        params.write_text((ROOT / "params.yaml").read_text())
        code = main(["engineer-config", "--params", str(params), "--set", "engineer.engineer=api", "--set",
                     f"engineer.base_url={url}", "--set", "engineer.api_key_env=HOSTILE_KEY", "--set", "engineer.attempts=1",
                     "--set", "engineer.feasibility_check=false", "--summary", str(tmp_path / "s.json"), "--config",
                     str(tmp_path / "c.yaml"), "--stage", "0", "--out-config", str(tmp_path / "n.yaml"), "--out-log",
                     str(tmp_path / "log.json")])
        printed = capsys.readouterr()
        assert code == 0
        for text in ((tmp_path / "log.json").read_text(), (tmp_path / "n.yaml").read_text(), printed.out, printed.err):
            assert KEY not in text
    finally:
        srv.shutdown()
        other.shutdown()


def test_a_rollout_against_an_endpoint_that_answers_nonsense_exits_2(capsys, tmp_path, monkeypatch):
    from envgen.core.config import EnvConfig
    from envgen.formats.dataset import write_instances
    from envgen.generator import generate
    from tests.helpers import ROOT

    cfg = EnvConfig.from_yaml(GOOD_CONFIG)
    write_instances(tmp_path / "i.parquet", generate(cfg), cfg)
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    srv, url, _ = endpoint({"body": '{"choices": "x"}'})
    try:
        code, _, err = run(capsys, "rollout", "--params", params, "--set", "rollout.backend=openai", "--set",
                           f"rollout.base_url={url}", "--set", "rollout.api_key_env=NO_SUCH_VARIABLE", "--instances",
                           tmp_path / "i.parquet",
                           "--out", tmp_path / "t.parquet", "--no-progress")
        assert_one_clear_error(code, err)
        assert "no choices" in err
    finally:
        srv.shutdown()


def test_random_bytes_never_crash_the_readers(tmp_path, capsys):
    """A light fuzz of the file readers with random bytes (seeded): a one-line error, never a traceback."""
    rng = random.Random(0)
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_CONFIG)
    for k in range(40):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        path = tmp_path / f"f{k}"
        path.write_bytes(data)
        assert_one_clear_error(*run(capsys, "validate-config", path)[::2])
        assert run(capsys, "check-plan", "--map", MOVINGAI / "ok.map", "--scen", MOVINGAI / "ok.scen", "--agents", 2,
                   "--plan", path)[0] == 2
        assert run(capsys, "solve", "--map", path, "--scen", MOVINGAI / "ok.scen", "--agents", 2)[0] == 2


# ------------------------------------------------------------------------------------ broken files between the steps
@pytest.fixture(scope="module")
def stage_files(tmp_path_factory):
    """A stage's real inputs for summarize-failures and evaluate: a configuration, its instances, answers to them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from envgen.core.config import EnvConfig
    from envgen.formats.dataset import generate_verified, write_instances
    from envgen.formats.schemas import TRAJECTORIES

    root = tmp_path_factory.mktemp("stage")
    (root / "c.yaml").write_text(GOOD_CONFIG)
    config = EnvConfig.from_yaml(GOOD_CONFIG)
    write_instances(root / "i.parquet", generate_verified(config), config)
    rows = [{"instance_id": r["instance_id"], "content_hash": r["content_hash"], "stage": 0, "sample_index": 0,
             "size": r["size"], "num_agents": r["num_agents"], "needs_wait": r["needs_wait"], "instance": r["instance"],
             "completion": "x", "parsed": False, "parse_error": "empty", "valid": False, "optimal": False,
             "optimal_soc": r["optimal_soc"], "reward": 0.0, "model_id": "m", "seed": 0, "finish_reason": "stop",
             "token_budget": 60, "optimal_tokens": 30} for r in pq.read_table(root / "i.parquet").to_pylist()]
    pq.write_table(pa.Table.from_pylist(rows, schema=TRAJECTORIES.schema), root / "v.parquet")
    (root / "m.json").write_text(json.dumps({"train/trajectories": 0}))
    return root


def broken_parquets(source: Path, root: Path) -> dict[str, Path]:
    """From the good Parquet ``source``: an empty file, a truncated one, a Parquet of other columns and one whose flags
    are text, in ``root``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "empty.parquet").write_bytes(b"")
    good = source.read_bytes()
    (root / "truncated.parquet").write_bytes(good[: len(good) // 2])
    pq.write_table(pa.table({"other": [1, 2]}), root / "other.parquet")
    table = pq.read_table(source)
    texts = table.set_column(table.column_names.index("valid"), "valid", pa.array(["maybe"] * table.num_rows))
    pq.write_table(texts, root / "text-flags.parquet")
    return {name: root / f"{name}.parquet" for name in ("empty", "truncated", "other", "text-flags")}


@pytest.mark.parametrize("which", ["--validation", "--instances", "--completions"])
def test_summarize_failures_names_a_broken_input_file_in_one_line(which, stage_files, capsys, tmp_path):
    base = {"--stage": 0, "--config": stage_files / "c.yaml", "--instances": stage_files / "i.parquet",
            "--validation": stage_files / "v.parquet", "--out-json": tmp_path / "s.json", "--out-md": tmp_path / "s.md"}
    assert run(capsys, "summarize-failures", *[x for kv in base.items() for x in kv])[0] == 0
    for name, broken in broken_parquets(stage_files / "v.parquet", tmp_path).items():
        argv = {**base, which: broken, "--out-json": tmp_path / f"{name}.json"}
        code, _, err = run(capsys, "summarize-failures", *[x for kv in argv.items() for x in kv])
        assert_one_clear_error(code, err)
        assert str(broken) in err and not (tmp_path / f"{name}.json").exists(), err
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run(capsys, "summarize-failures", *[x for kv in {**base, "--metrics": deep}.items() for x in kv])
    assert_one_clear_error(code, err)
    assert str(deep) in err


def test_evaluate_refuses_a_broken_reference_and_leaves_no_output(stage_files, capsys, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bench = pq.read_table(stage_files / "i.parquet")
    bench = bench.append_column("wait_subset", pa.array([0.5] * bench.num_rows, pa.float32()))
    pq.write_table(bench, tmp_path / "b.parquet")
    outs = {"--out-metrics": tmp_path / "m.json", "--out-table": tmp_path / "t.md", "--out-full": tmp_path / "f.json"}
    base = ["evaluate", "--benchmark", tmp_path / "b.parquet", "--trajectories", stage_files / "v.parquet",
            *[x for kv in outs.items() for x in kv]]
    deep, shapeless = tmp_path / "deep.json", tmp_path / "shapeless.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    shapeless.write_text(json.dumps({"cbs": {"3": {"sizes": {"3": "all of them"}}}}))
    for reference in (deep, shapeless, tmp_path / "missing.json"):
        code, _, err = run(capsys, *base, "--reference", reference)
        assert_one_clear_error(code, err)
        assert str(reference) in err and not any(p.exists() for p in outs.values()), err
    code, _, err = run(capsys, *base[:3], "--trajectories", stage_files / "i.parquet", *base[5:])
    assert_one_clear_error(code, err)  # instances where answers belong: named, with what is missing
    assert "no column" in err and str(stage_files / "i.parquet") in err
    assert run(capsys, *base)[0] == 0 and all(p.exists() for p in outs.values())


def test_a_board_of_30_agents_or_a_large_picture_stays_bounded(capsys, tmp_path):
    """Text views label agents A to Z: 30 agents is one line naming the limit; a PNG of the largest board is at most
    4,096 pixels a side (48 pixels a cell would be 49,152: about 7 GB)."""
    from PIL import Image

    from envgen.core.instance import MAX_SIDE, Instance
    from envgen.core.render import MAX_PNG_SIDE, render_png

    crowd = Instance(tuple("F" * 10 for _ in range(10)), tuple((r, c) for r in range(3) for c in range(10)),
                     tuple((r, c) for r in range(7, 10) for c in range(10)))
    (tmp_path / "crowd.txt").write_text(crowd.to_str())
    assert_one_clear_error(*run(capsys, "render", "--instance-file", tmp_path / "crowd.txt")[::2])
    large = Instance(tuple("F" * MAX_SIDE for _ in range(MAX_SIDE)), ((0, 0), (1, 1)), ((5, 5), (6, 6)))
    png = render_png(large, tmp_path / "large.png", title="the largest board")
    import io

    width, height = Image.open(io.BytesIO(png)).size
    assert width <= MAX_PNG_SIDE + 1 and height <= MAX_PNG_SIDE + 1 + 22  # the title takes a line of 22 pixels


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_refused_before_anything_loads(port, capsys):
    code, out, err = run(capsys, "serve", "--model", "no-such-model", "--port", port)
    assert_one_clear_error(code, err)
    assert "--port" in err and "serving" not in out


def test_pool_workers_end_with_their_parent_when_it_is_killed(tmp_path):
    """build-benchmark's worker processes (pipeline.workers.worker_pool): SIGKILL the parent and they go too."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    script = ("import time, sys; sys.path.insert(0, %r)\n"
              "import psutil\n"
              "from pipeline.workers import worker_pool\n"
              "pool = worker_pool(2)\n"
              "futures = [pool.submit(time.sleep, 60) for _ in range(2)]\n"
              "time.sleep(1); print(' '.join(str(c.pid) for c in psutil.Process().children()), flush=True)\n"
              "time.sleep(60)\n" % str(Path(__file__).resolve().parents[1]))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    workers = [int(p) for p in parent.stdout.readline().split()]
    assert len(workers) == 2 and all(psutil.pid_exists(p) for p in workers)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in workers if psutil.pid_exists(p)], timeout=10)
    assert not alive, [p.pid for p in alive]


def test_the_solver_and_the_instance_checks_stay_within_their_budgets(tmp_path, capsys):
    """The solver's time budget counts from its start (the agents' distance tables included) and an instance too large
    for its tables is given up at once; rows beyond the schema's bounds are not solved by the data check."""
    import time as clock

    import pyarrow as pa
    import pyarrow.parquet as pq

    from envgen.solver.cbs import SolverBudget, UnsolvedReason, solve
    from envgen.core.instance import Instance

    side = 1024
    big = Instance(tuple("F" * side for _ in range(side)), tuple((0, c) for c in range(50)),
                   tuple((side - 1, c) for c in range(50)))
    began = clock.perf_counter()
    result = solve(big, SolverBudget(max_seconds=1))
    assert result.reason is UnsolvedReason.SIZE_BUDGET and clock.perf_counter() - began < 5
    crowd = Instance(tuple("F" * 60 for _ in range(60)), tuple((r, c) for r in range(20) for c in range(60)),
                     tuple((r, c) for r in range(40, 60) for c in range(60)))
    row = {"instance": crowd.to_str(), "content_hash": crowd.content_hash, "size": 60, "num_agents": crowd.num_agents}
    pq.write_table(pa.Table.from_pylist([row] * 4), tmp_path / "crowd.parquet")
    began = clock.perf_counter()
    code, _, err = run(capsys, "check-data", "--kind", "instances", tmp_path / "crowd.parquet")
    assert code != 0 and clock.perf_counter() - began < 60, err[-300:]


# --------------------------------------------------------------------------------- endpoints that send too much
class Raw(BaseHTTPRequestHandler):
    """An endpoint whose reply the test writes byte by byte (``act``)."""

    act: Any = None

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            type(self).act(self)
        except (BrokenPipeError, ConnectionResetError):
            pass


def raw_endpoint(act) -> tuple[ThreadingHTTPServer, str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Raw,), {"act": staticmethod(act)}))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/v1"


def _head(handler, status: int, headers: dict) -> None:
    handler.send_response(status)
    for k, v in headers.items():
        handler.send_header(k, v)
    handler.end_headers()


def gzip_bomb(handler) -> None:
    import gzip

    payload = gzip.compress(b'{"choices": [{"message": {"content": "' + b"a" * 64_000_000 + b'"}}]}', 9)
    _head(handler, 200, {"Content-Encoding": "gzip", "Content-Length": str(len(payload))})
    handler.wfile.write(payload)


def endless_500(handler) -> None:
    _head(handler, 500, {"Content-Type": "text/plain"})
    for _ in range(100_000):
        handler.wfile.write(b"x" * 65536)


def bad_gzip(handler) -> None:
    _head(handler, 200, {"Content-Encoding": "gzip", "Content-Length": "12"})
    handler.wfile.write(b"not gzip at all"[:12])


def trickle(handler) -> None:
    _head(handler, 200, {"Content-Length": "1000"})
    for _ in range(1000):
        handler.wfile.write(b" ")
        handler.wfile.flush()
        time.sleep(0.2)


@pytest.mark.parametrize("act", [gzip_bomb, endless_500, bad_gzip, trickle], ids=lambda f: f.__name__)
def test_an_endpoint_that_sends_too_much_or_too_slowly_is_a_bounded_backend_error(act):
    import tracemalloc

    from policy.backends import BackendError, OpenAIBackend, SamplingParams

    srv, url = raw_endpoint(act)
    try:
        client = OpenAIBackend(url, "m", api_key_env=None, timeout_s=3, max_retries=0)
        tracemalloc.start()
        began = time.monotonic()
        with pytest.raises(BackendError):
            client.generate([[{"role": "user", "content": "hi"}]], 1, SamplingParams(stop=()))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert time.monotonic() - began < 10 and peak < 200_000_000, (time.monotonic() - began, peak)
    finally:
        srv.shutdown()


def test_the_key_goes_to_no_proxy_and_base_url_holds_no_credentials_or_query(monkeypatch):
    from policy.backends import BackendError, OpenAIBackend, SamplingParams

    monkeypatch.setenv("HOSTILE_KEY", KEY)
    proxy, proxy_url, proxy_handler = endpoint({"body": answer_with_key})
    srv, url, handler = endpoint({"status": 401, "body": lambda h: '{"error": "' + "".join(
        f"\\u{ord(c):04x}" for c in h.get("Authorization")) + '"}'})  # JSON that spells the key in escapes
    try:
        monkeypatch.setenv("HTTP_PROXY", proxy_url.removesuffix("/v1"))
        monkeypatch.setenv("http_proxy", proxy_url.removesuffix("/v1"))
        client = OpenAIBackend(url, "m", api_key_env="HOSTILE_KEY", max_retries=0)
        with pytest.raises(BackendError) as caught:
            client.generate([[{"role": "user", "content": "hi"}]], 1, SamplingParams(stop=()))
        assert KEY not in str(caught.value) and "***" in str(caught.value)
        assert handler.seen and not proxy_handler.seen
    finally:
        srv.shutdown()
        proxy.shutdown()
    for bad in ("http://user:secret@127.0.0.1:9/v1", "http://127.0.0.1:9/v1?x=1", "http://127.0.0.1:9/v1#frag"):
        with pytest.raises(ValueError, match="base_url") as caught:
            OpenAIBackend(bad, "m")
        assert "secret" not in str(caught.value)


def test_silent_and_slow_clients_are_cut_off_and_the_server_answers_others(tiny_model_dir):
    """A connection that sends nothing, headers a byte at a time, or a body shorter than it announced: closed, or
    answered 408, within the read timeout; meanwhile /health answers."""
    import httpx

    from policy.backends import TransformersBackend
    from policy.serve import RunningServer, ServeLimits, make_app

    backend = TransformersBackend(str(tiny_model_dir), device="cpu", batch_size=1, threads=1)
    running = RunningServer(make_app(backend, "tiny", None, ServeLimits(read_timeout_s=1.0)), read_timeout_s=1.0)
    try:
        from urllib.parse import urlsplit

        parts = urlsplit(running.url)
        silent = [socket.create_connection((parts.hostname, parts.port), timeout=10) for _ in range(20)]
        slow = socket.create_connection((parts.hostname, parts.port), timeout=10)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHo")
        short = socket.create_connection((parts.hostname, parts.port), timeout=10)
        short.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 999999\r\n\r\n{\"messages\": ")
        assert httpx.get(running.url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
        began = time.monotonic()
        for sock in [*silent, slow]:
            assert sock.recv(100) == b""  # closed by the server
        reply = short.recv(1000)
        assert b" 408 " in reply.split(b"\r\n")[0] and time.monotonic() - began < 8, reply[:100]
        for sock in [*silent, slow, short]:
            sock.close()
        assert httpx.post(f"{running.url}/chat/completions", json=HELLO, timeout=60).status_code == 200
    finally:
        running.stop()
