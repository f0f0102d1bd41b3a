import json
import os
import shutil
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from envgen.core.instance import Instance
from envgen.llm.prompt import build_messages
from policy.backends import BackendError, OpenAIBackend, SamplingParams, TransformersBackend, VLLMBackend, make_backend
from policy.serve import RunningServer, ServeLimits, make_app

CONVS = [build_messages(Instance(("FF", "FF"), ((0, 0), (1, 1)), ((1, 1), (0, 0))))] * 3
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def tiny_backend(tiny_model_dir):
    return TransformersBackend(str(tiny_model_dir), device="cpu", batch_size=2, threads=1)


@pytest.fixture()
def served(tiny_backend):
    servers = []

    def start(api_key=None, limits=ServeLimits()):
        server = RunningServer(make_app(tiny_backend, "tiny", api_key, limits))
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.stop()


def test_transformers_backend_batches_samples_and_seeds(tiny_backend):
    seen = []
    out = tiny_backend.generate(CONVS, 2, PARAMS, on_progress=seen.append)
    assert len(out) == 3 and all(len(g) == 2 for g in out) and sum(seen) == 3
    g = out[0][0]
    assert g.prompt_tokens > 50 and 0 <= g.completion_tokens <= 12 and g.finish_reason in ("stop", "length")
    again = tiny_backend.generate(CONVS, 2, PARAMS)
    assert [[x.text for x in gens] for gens in again] == [[x.text for x in gens] for gens in out]
    greedy = tiny_backend.generate(CONVS[:1], 2, SamplingParams(max_new_tokens=8, temperature=0))
    assert greedy[0][0].text == greedy[0][1].text


def test_static_cache_matches_dynamic_and_bad_options_name_the_fix(tiny_backend):
    """The static KV cache (compiled on CUDA; eager here) gives the same greedy tokens as the dynamic one, even with
    prompts padded to a multiple of 64 tokens; settings are checked and name their choices."""
    from policy.backends import TransformersBackend

    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    convs = [CONVS[0], build_messages(Instance(("FFF", "FHF", "FFF"), ((0, 0), (2, 2)), ((2, 2), (0, 0))))]
    assert not tiny_backend.static_cache  # 'auto' on a CPU
    dynamic = tiny_backend.generate(convs, 1, greedy)
    static = TransformersBackend.from_loaded(tiny_backend.loaded, batch_size=2, cache="static", compile_backend="none")
    assert static.static_cache
    assert tiny_backend.loaded.model.config.num_key_value_heads < tiny_backend.loaded.model.config.num_attention_heads
    out = static.generate(convs, 1, greedy)  # grouped-query decode attention (policy/attention.py) on the static cache
    assert tiny_backend.loaded.model.config._attn_implementation == "sdpa"  # restored after the call
    assert [g[0].text for g in out] == [g[0].text for g in dynamic]
    assert [g[0].prompt_tokens for g in out] == [g[0].prompt_tokens for g in dynamic]  # padding is not counted
    with pytest.raises(ValueError, match="cache = 'fast': choose 'auto', 'static' or 'dynamic'"):
        TransformersBackend.from_loaded(tiny_backend.loaded, cache="fast")
    with pytest.raises(ValueError, match="compile_backend = 'xla'"):
        TransformersBackend.from_loaded(tiny_backend.loaded, compile_backend="xla")
    with pytest.raises(TypeError, match="unknown options"):
        TransformersBackend.from_loaded(tiny_backend.loaded, colour="red")


def test_static_cache_gives_every_batch_of_a_call_one_shape(tiny_backend, monkeypatch):
    """With the static cache every batch of a call has the same shape (the longest prompt, rounded up; the last batch
    filled up), so the decode step compiles once per call; answers equal the dynamic cache's, extras dropped."""
    from policy.backends import TransformersBackend

    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    convs = [CONVS[0], build_messages(Instance(("FFF", "FHF", "FFF"), ((0, 0), (2, 2)), ((2, 2), (0, 0)))), CONVS[1]]
    dynamic = tiny_backend.generate(convs, 1, greedy)
    static = TransformersBackend.from_loaded(tiny_backend.loaded, batch_size=2, cache="static", compile_backend="none",
                                             pad_multiple=16)
    shapes = []
    original = static.generate_ids
    monkeypatch.setattr(static, "generate_ids", lambda ids, *a, **k: shapes.append(tuple(ids.shape)) or original(ids, *a, **k))
    out = static.generate(convs, 1, greedy)
    assert len(shapes) == 2 and shapes[0] == shapes[1] and shapes[0][0] == 2 and shapes[0][1] % 16 == 0
    assert len(out) == 3 and [g[0].text for g in out] == [g[0].text for g in dynamic]


def test_grouped_decode_attention_equals_transformers_sdpa():
    """One decoded token against a masked cache (boolean or additive): the packed grouped-query attention gives
    transformers' SDPA result (which copies keys and values per head group) for every head; other shapes are passed
    through unchanged."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from policy.attention import grouped_decode_sdpa

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    batch, kv, length, dim = 3, 2, 10, 8
    key, value = torch.randn(batch, kv, length, dim), torch.randn(batch, kv, length, dim)
    mask = torch.ones(batch, 1, 1, length + 6, dtype=torch.bool)  # a static cache's mask: longer than the keys given
    mask[0, ..., :4] = False  # left padding of sequence 0
    mask[:, ..., length:] = False
    query = torch.randn(batch, kv * 4, 1, dim)
    got, _ = grouped_decode_sdpa(module, query, key, value, mask, scaling=dim**-0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask[..., :length], scaling=dim**-0.5)
    assert got.shape == want.shape == (batch, 1, kv * 4, dim)
    assert torch.allclose(got, want, atol=1e-5)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # a float mask, same meaning
    got, _ = grouped_decode_sdpa(module, query, key, value, additive, scaling=dim**-0.5)
    assert torch.allclose(got, want, atol=1e-5)
    from policy.attention import set_decode_kernel

    try:
        for kernel in ("math", "sdpa"):  # a pinned kernel computes the same
            set_decode_kernel(kernel)
            for given in (mask, additive):
                got, _ = grouped_decode_sdpa(module, query, key, value, given, scaling=dim**-0.5)
                assert torch.allclose(got, want, atol=1e-5), kernel
    finally:
        set_decode_kernel("auto")
    with pytest.raises(ValueError, match="choose one of auto"):
        set_decode_kernel("fast")
    prefill = torch.randn(batch, kv * 4, 5, dim)  # several query positions: transformers' own path
    got, _ = grouped_decode_sdpa(module, prefill, key, value, None, scaling=dim**-0.5)
    want, _ = sdpa_attention_forward(module, prefill, key, value, None, scaling=dim**-0.5)
    assert torch.equal(got, want)


def test_gpu_benchmark_script_measures_every_variant(tmp_path):
    """bench/gpu.py on a tiny architecture on the CPU: every rollout and training variant yields a row with tokens/s,
    and the JSON holds them (its real use is on a GPU: docs/lab-notes/benchmarks.md)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpu

    out = tmp_path / "gpu.json"
    gpu.main(["--archs", "tiny", "--device", "cpu", "--dtype", "float32", "--rollout", "plain:2,dynamic:2,static:3,static+math:3",
              "--prompt-len", "8", "--new-tokens", "4", "--train-batch", "2", "--train-seq", "16", "--train-completion", "8",
              "--train", "lm+ckpt,grpo+ckpt,grpo:3", "--train-steps", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]["tiny"]
    assert [(r["part"], r["variant"]) for r in rows] == [("rollout", "plain"), ("rollout", "dynamic"), ("rollout", "static"),
                                                        ("rollout", "static+math"), ("train", "lm+ckpt"), ("train", "grpo+ckpt"),
                                                        ("train", "grpo")]
    assert all("error" not in r and r["tok_per_s"] > 0 for r in rows)
    assert [r["tokens"] for r in rows[:4]] == [8, 8, 12, 12]  # rows x new tokens: nothing stopped early
    assert rows[3]["decode_kernel"] == "math" and [r["batch"] for r in rows[4:]] == [2, 2, 3]
    with pytest.raises(SystemExit):  # a kernel SDPA does not have
        gpu.main(["--archs", "tiny", "--device", "cpu", "--rollout", "static+fast:2", "--train", ""])
    assert gpu.forward_flops_per_token("qwen3-4b", 512) / 2 == pytest.approx(4.0e9, rel=0.05)  # ~4B weights in matmuls


def test_the_backend_registry_and_the_settings_name_the_same_backends():
    from typing import get_args

    from pipeline.params import BackendName
    from policy.backends import BACKENDS

    assert set(BACKENDS) == set(get_args(BackendName))


@pytest.mark.parametrize("name", ["transformers", "vllm", "openai"])
def test_every_registered_backend_builds_from_its_options_and_answers_in_the_one_format(name, tiny_model_dir, served):
    """The registry's contract: each factory of BACKENDS takes the options steps.rollout gives it and returns n
    Generations per conversation; one that cannot run here (vLLM without a GPU) says how to get it."""
    from pipeline.params import PolicySettings, RolloutSettings
    from policy.backends import BACKENDS, Generation
    settings = RolloutSettings(backend=name, base_url=served() if name == "openai" else None, api_key_env="", threads=1)
    options = settings.backend_options(PolicySettings(model=str(tiny_model_dir)).model, None)
    try:
        backend = make_backend(name, **options)
    except BackendError as e:
        assert name == "vllm" and "pip install -e '.[gpu]'" in str(e)
        return
    out = backend.generate(CONVS[:2], 2, PARAMS)
    assert isinstance(backend, BACKENDS[name]) and backend.model_id
    assert len(out) == 2 and all(len(g) == 2 and all(isinstance(x, Generation) for x in g) for g in out)
    assert all(x.finish_reason in ("stop", "length") and x.completion_tokens >= 0 for g in out for x in g)


def test_registry_and_missing_vllm():
    with pytest.raises(ValueError, match="choose one of"):
        make_backend("nope")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(BackendError, match=r"pip install -e '\.\[gpu\]'"):
            VLLMBackend("embedded")


def test_vllm_backend_seeds_each_conversation_apart():
    """Each conversation's request carries its own seed (params.seed + i * n, its samples the next ones, as vLLM seeds
    them): conversations sharing one seed would share one noise stream. A stand-in engine records the requests."""
    from types import SimpleNamespace

    class Engine:
        def chat(self, conversations, params, lora_request=None, use_tqdm=False):
            self.params = params
            return [SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[
                SimpleNamespace(text="x", token_ids=[4], finish_reason="stop") for _ in range(p.n)]) for p in params]

    backend = object.__new__(VLLMBackend)  # no vLLM here: only the request building and the records are tested
    backend._vllm = SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw))
    backend.engine, backend.adapter = Engine(), None
    out = backend.generate(CONVS, 2, PARAMS)
    assert [p.seed for p in backend.engine.params] == [7, 9, 11] and all(p.n == 2 for p in backend.engine.params)
    assert [[g.seed for g in gens] for gens in out] == [[7, 8], [9, 10], [11, 12]]


def test_openai_backend_seeds_each_conversation_apart(monkeypatch):
    """Each conversation's requests carry seeds of their own (params.seed + i * n, then + the samples already had),
    recorded with the generations; an endpoint that returns fewer choices is asked again for the rest."""
    backend = OpenAIBackend("http://127.0.0.1:9/v1", "m", api_key_env="")
    bodies = []

    def post(body):
        bodies.append(body)
        return {"choices": [{"message": {"content": "x"}, "finish_reason": "length"}]}  # one choice per request

    monkeypatch.setattr(backend, "_post", post)
    out = backend.generate(CONVS[:2], 2, PARAMS)
    assert [(b["seed"], b["n"]) for b in bodies] == [(7, 2), (8, 1), (9, 2), (10, 1)]
    assert [[g.seed for g in gens] for gens in out] == [[7, 8], [9, 10]]


class _Batching(BaseHTTPRequestHandler):
    """A stand-in for a server that batches what it receives (vLLM): holds each completion request a moment, counts
    how many are in flight at once, records every request, and loads LoRA adapters at runtime by name."""

    lock = threading.Lock()
    in_flight = most = 0
    bodies: list = []
    loaded: dict = {}

    def log_message(self, *args):
        pass

    def _reply(self, status, text, kind="application/json"):
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.bodies.append((self.path, body))
        if self.path == "/v1/load_lora_adapter":
            if body["lora_name"] in cls.loaded:  # vLLM's words for an adapter it holds
                return self._reply(400, json.dumps({"message": f"The lora adapter '{body['lora_name']}' has already "
                                                               "been loaded.", "code": 400}))
            cls.loaded[body["lora_name"]] = body["lora_path"]
            return self._reply(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.", "text/plain")
        if body["messages"][0]["content"] == "fail":
            return self._reply(400, json.dumps({"message": "bad request"}))
        with cls.lock:
            cls.in_flight += 1
            cls.most = max(cls.most, cls.in_flight)
        threading.Event().wait(0.2)
        with cls.lock:
            cls.in_flight -= 1
        self._reply(200, json.dumps({"choices": [{"message": {"content": f"seed {body['seed']} model {body['model']}"},
                                                  "finish_reason": "stop"}]}))


@pytest.fixture()
def batching():
    _Batching.in_flight = _Batching.most = 0
    _Batching.bodies, _Batching.loaded = [], {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Batching)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_backend_keeps_requests_in_flight_and_the_answers_in_order(batching):
    """``concurrency``: up to that many conversations' requests at once (a batching server answers them together),
    each answer where its conversation is and seeded as one at a time would be; the first error stops the rest."""
    convs = [[{"role": "user", "content": f"board {i}"}] for i in range(12)]
    seen = []
    out = OpenAIBackend(batching, "m", api_key_env="", concurrency=4).generate(convs, 1, PARAMS, on_progress=seen.append)
    assert [[g.text for g in gens] for gens in out] == [[f"seed {7 + i} model m"] for i in range(12)]
    assert 1 < _Batching.most <= 4 and sum(seen) == 12
    one_at_a_time = OpenAIBackend(batching, "m", api_key_env="").generate(convs[:3], 2, PARAMS)
    assert [[g.seed for g in gens] for gens in one_at_a_time] == [[7, 8], [9, 10], [11, 12]]
    with pytest.raises(BackendError, match="HTTP 400"):
        OpenAIBackend(batching, "m", api_key_env="", concurrency=4, max_retries=0).generate(
            convs[:6] + [[{"role": "user", "content": "fail"}]] + convs[6:], 1, PARAMS)
    with pytest.raises(ValueError, match="concurrency"):
        OpenAIBackend(batching, "m", concurrency=0)


def test_openai_backend_counts_tokens_with_the_served_models_tokenizer(tiny_backend, tiny_model_dir, capsys):
    """Budgets as the other backends give them: the local model's tokenizer; without one, bytes (an upper bound)."""
    text = "Agent 1: UP RIGHT WAIT"
    counted = OpenAIBackend("http://127.0.0.1:9/v1", "m", api_key_env="", tokenizer=str(tiny_model_dir))
    assert counted.count_tokens(text) == tiny_backend.count_tokens(text) < len(text)
    bytewise = OpenAIBackend("http://127.0.0.1:9/v1", "m", api_key_env="", tokenizer="no-org/no-model")
    assert bytewise.count_tokens(text) == len(text) and "counted in UTF-8 bytes" in capsys.readouterr().err


def test_answer_token_counts_from_tokenizer_json_are_the_tokenizers_own_without_torch(tiny_model_dir):
    """The rollout client counts budgets from ``tokenizer.json`` (the ``tokenizers`` library): the same counts as the
    model's transformers tokenizer, and torch is never imported for them."""
    import subprocess
    import sys

    from policy.models import answer_token_counter, load_tokenizer

    texts = ["Agent 1: UP RIGHT WAIT", "<answer>\nA1: (0,0) R (0,1) D (1,1)\nA2: W W U</answer>", " leading space",
             "trace: t=3 a2 waits; é ü 10x10", "", "\n\n"]
    tok, count = load_tokenizer(str(tiny_model_dir)), answer_token_counter(str(tiny_model_dir))
    assert [count(t) for t in texts] == [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    code = ("import sys; from policy.models import answer_token_counter; "
            f"n = answer_token_counter({str(tiny_model_dir)!r})('A1: U R'); print(n, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[1] == "False" and int(out.stdout.split()[0]) > 0, out.stderr


def test_openai_backend_loads_its_adapter_into_the_server_and_asks_for_it_by_name(batching, tmp_path):
    """With ``adapter``, the server loads it at runtime (vLLM's ``/v1/load_lora_adapter``) under a name made of its
    content hash, and every request names it as the model; an adapter the server holds already is simply used."""
    from policy.models import adapter_hash

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    import hashlib

    name = f"adapter-{adapter_hash(adapter)}-{hashlib.sha256(str(adapter.resolve()).encode()).hexdigest()[:8]}"
    backend = OpenAIBackend(batching, "embedded", api_key_env="", adapter=adapter)
    assert _Batching.loaded == {name: str(adapter.resolve())} and backend.served_as == name
    assert backend.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the records name the base model, as locally
    assert backend.adapter_hash == adapter_hash(adapter)
    assert backend.generate(CONVS[:1], 1, PARAMS)[0][0].text == f"seed 7 model {name}"
    again = OpenAIBackend(batching, "embedded", api_key_env="", adapter=adapter)  # 400 "already been loaded": fine
    assert again.served_as == name and len(_Batching.loaded) == 1
    copy = tmp_path / "elsewhere"  # the same weights in another experiment's folder: loaded from there, apart
    shutil.copytree(adapter, copy)
    other = OpenAIBackend(batching, "embedded", api_key_env="", adapter=copy)
    assert other.adapter_hash == backend.adapter_hash and other.served_as != name
    assert _Batching.loaded[other.served_as] == str(copy.resolve())
    with pytest.raises(BackendError, match="--enable-lora"):  # a server that cannot load adapters says so
        OpenAIBackend("http://127.0.0.1:9/v1", "embedded", api_key_env="", adapter=adapter, max_retries=0)


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model_dir, tmp_path_factory):
    """Two LoRA adapters of the tiny model whose B matrices are not zero, so that each answers otherwise than the
    base model, in one folder."""
    import torch

    from policy.lora import load_trainable, save_adapter

    root = tmp_path_factory.mktemp("adapters")
    for k in (1, 2):
        model, tok = load_trainable(str(tiny_model_dir), r=4, device="cpu", seed=k)
        torch.manual_seed(k)
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.data.normal_(0, 2.0)
        save_adapter(model, tok, root / f"a{k}", str(tiny_model_dir))
    return root


def test_serve_loads_adapters_at_runtime_and_answers_with_the_one_a_request_names(tiny_backend, tiny_model_dir,
                                                                                   tiny_adapters, tmp_path):
    """``--adapters-from``: the openai backend loads a stage's adapter into the warm server (vLLM's endpoint) and
    gets the answers that adapter gives in a process of its own; one dropped for room is loaded again when asked for;
    a folder outside the server's is refused; a server without it says how to turn it on."""
    from policy.serve_adapters import AdapterShelf

    def make(folder):
        return TransformersBackend(str(tiny_model_dir), str(folder), device="cpu", batch_size=2, threads=1)

    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, seed=7)
    server = RunningServer(make_app(tiny_backend, "tiny", None, ServeLimits(),
                                    adapters=AdapterShelf(tiny_adapters, make, capacity=1)))
    try:
        answers = {}
        for k in (1, 2, 1):  # with room for one, a1 is dropped when a2 loads, and loaded again for the third
            client = OpenAIBackend(server.url, "tiny", api_key_env="", adapter=tiny_adapters / f"a{k}",
                                   tokenizer=str(tiny_model_dir))
            answers.setdefault(k, []).append(client.generate(CONVS[:1], 1, greedy)[0][0].text)
        local = {k: make(tiny_adapters / f"a{k}").generate(CONVS[:1], 1, greedy)[0][0].text for k in (1, 2)}
        base = OpenAIBackend(server.url, "tiny", api_key_env="").generate(CONVS[:1], 1, greedy)[0][0].text
        assert answers == {1: [local[1], local[1]], 2: [local[2]]}
        assert base == tiny_backend.generate(CONVS[:1], 1, greedy)[0][0].text and len({base, local[1], local[2]}) == 3
        outside = tmp_path / "a3"
        shutil.copytree(tiny_adapters / "a1", outside)
        (outside / "extra").write_text("x")  # another content hash: not one the server holds
        with pytest.raises(BackendError, match="loads adapters from under"):
            OpenAIBackend(server.url, "tiny", api_key_env="", adapter=outside, max_retries=0)
        import httpx

        for body in ({"lora_name": "../up", "lora_path": str(tiny_adapters / "a1")}, {"lora_name": "x"}, ["x"]):
            reply = httpx.post(server.url + "/load_lora_adapter", json=body, trust_env=False)
            assert reply.status_code == 400 and "lora_" in reply.json()["error"]["message"], reply.text
    finally:
        server.stop()
    plain = RunningServer(make_app(tiny_backend, "tiny"))
    try:
        with pytest.raises(BackendError, match="--adapters-from"):
            OpenAIBackend(plain.url, "tiny", api_key_env="", adapter=tiny_adapters / "a1", max_retries=0)
    finally:
        plain.stop()


def test_openai_backend_against_the_real_server(tiny_backend, served):
    url = served()
    client = OpenAIBackend(url, "tiny", api_key_env="")
    remote = client.generate(CONVS[:1], 2, PARAMS)
    local = tiny_backend.generate(CONVS[:1], 2, PARAMS)
    assert [g.text for g in remote[0]] == [g.text for g in local[0]]
    assert remote[0][0].prompt_tokens == local[0][0].prompt_tokens
    with pytest.raises(BackendError, match="HTTP 400"):
        OpenAIBackend(url, "tiny", api_key_env="", extra_body={"n": 100}).generate(CONVS[:1], 1, PARAMS)


def test_api_key_is_required_and_never_echoed(served, monkeypatch):
    url = served(api_key="sekret-123")
    monkeypatch.delenv("TEST_KEY", raising=False)
    with pytest.raises(BackendError, match="HTTP 401") as info:
        OpenAIBackend(url, "tiny", api_key_env="TEST_KEY", max_retries=3, backoff_s=5).generate(CONVS[:1], 1, PARAMS)
    monkeypatch.setenv("TEST_KEY", "wrong-key-456")
    with pytest.raises(BackendError) as info:
        OpenAIBackend(url, "tiny", api_key_env="TEST_KEY").generate(CONVS[:1], 1, PARAMS)
    assert "wrong-key-456" not in str(info.value)
    monkeypatch.setenv("TEST_KEY", "sekret-123")
    assert len(OpenAIBackend(url, "tiny", api_key_env="TEST_KEY").generate(CONVS[:1], 1, PARAMS)[0]) == 1


def test_retries_with_backoff_on_server_errors():
    calls = []

    class Flaky(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(1)
            if len(calls) <= 2:
                self.send_response(503)
                self.end_headers()
                return
            body = json.dumps({"choices": [{"message": {"content": "Agent 1: UP"}, "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 5, "completion_tokens": 3}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = OpenAIBackend(f"http://127.0.0.1:{server.server_address[1]}/v1", "m", api_key_env="", backoff_s=0.01)
        out = client.generate(CONVS[:1], 1, SamplingParams(stop=()))
        assert out[0][0].text == "Agent 1: UP" and len(calls) == 3
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_endpoint_gives_up_with_a_clear_error():
    client = OpenAIBackend("http://127.0.0.1:9/v1", "m", api_key_env="", max_retries=2, backoff_s=0.01, timeout_s=2)
    with pytest.raises(BackendError, match="gave up after 3 attempts"):
        client.generate(CONVS[:1], 1, PARAMS)
    with pytest.raises(ValueError, match="http"):
        OpenAIBackend("ftp://x", "m")
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_api_engineer_gets_schema_valid_json_from_the_server(served):
    from engineers.summary import Summary
    from envgen.core.config import EnvConfig, SizeConfig
    from pipeline.params import EngineerSettings, PolicySettings
    from steps.engineer_config import engineer_config

    url = served()
    current = EnvConfig(budget=10, sizes={3: SizeConfig(data_ratio=1.0)})
    settings = EngineerSettings(engineer="api", base_url=url, api_model="tiny", api_key_env="", attempts=1,
                                max_new_tokens=300, context="failures")
    result = engineer_config(Summary(stage=0), current, settings, PolicySettings(), 0)
    raw = result.log["attempts"][0]["raw_output"]
    assert set(json.loads(raw)["sizes"]) == {"3"} and result.log["constrained"]


def test_a_schema_without_xgrammar_is_refused_not_answered_unconstrained(tiny_backend, served, monkeypatch):
    import sys
    import urllib.error
    import urllib.request

    from policy.backends import ConstrainedDecodingUnavailable

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    with pytest.raises(ConstrainedDecodingUnavailable, match="xgrammar"):
        tiny_backend.generate(CONVS[:1], 1, SamplingParams(max_new_tokens=4, json_schema=schema))
    body = {"messages": CONVS[0], "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(schema)}}}
    request = urllib.request.Request(served() + "/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    error = json.loads(caught.value.read())["error"]
    assert caught.value.code == 400 and error["param"] == "response_format" and "xgrammar" in error["message"]


def test_serve_command_checks_its_backend_settings(capsys):
    """`serve --backend vllm` builds vLLM's engine (GPU); here, without vLLM, it stops with the install hint, and
    settings out of range are named before anything loads."""
    import importlib.util

    from env_engineer.cli import main

    assert main(["serve", "--backend", "vllm", "--gpu-memory", "1.5"]) == 2
    assert "--gpu-memory 1.5" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:
        assert main(["serve", "--backend", "vllm"]) == 2
        assert "pip install -e '.[gpu]'" in capsys.readouterr().err


def test_policy_engineer_asks_the_served_policy_with_its_stage_adapter(batching, tmp_path):
    """Where the rollouts ask a served policy (``rollout.backend: openai``, a study's warm engine), the policy engineer
    asks it too: the stage's adapter loaded into the server, every attempt naming it, under the proposal's schema."""
    from engineers.summary import Summary
    from envgen.core.config import EnvConfig, SizeConfig
    from pipeline.params import EngineerSettings, PolicySettings, RolloutSettings
    from steps.engineer_config import engineer_config

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    served = RolloutSettings(backend="openai", base_url=batching, api_key_env=None)
    settings = EngineerSettings(engineer="policy", attempts=2, context="failures")
    current = EnvConfig(budget=10, sizes={3: SizeConfig(data_ratio=1.0)})
    result = engineer_config(Summary(stage=0), current, settings, PolicySettings(), 0, str(adapter), served=served)
    asked = [body for path, body in _Batching.bodies if path == "/v1/chat/completions"]
    assert list(_Batching.loaded.values()) == [str(adapter.resolve())]
    assert len(asked) == 2 and {body["model"] for body in asked} == set(_Batching.loaded)
    assert all(body["response_format"]["type"] == "json_schema" for body in asked)
    assert result.fallback and result.config.sizes == current.sizes  # no proposal in the answers: the sizes kept


def test_policy_engineer_gets_a_proposal_from_the_real_server_through_its_stage_adapter(tiny_backend, tiny_model_dir,
                                                                                          tiny_adapters):
    """The same against ``env-engineer serve --adapters-from``: the stage's adapter loaded at runtime, the answer
    decoded under the proposal's schema, a proposal for every size of the configuration."""
    from engineers.summary import Summary
    from envgen.core.config import EnvConfig, SizeConfig
    from pipeline.params import EngineerSettings, PolicySettings, RolloutSettings
    from policy.serve_adapters import AdapterShelf
    from steps.engineer_config import engineer_config

    loaded = []

    def make(folder):
        loaded.append(Path(folder))
        return TransformersBackend(str(tiny_model_dir), str(folder), device="cpu", batch_size=1, threads=1)

    server = RunningServer(make_app(tiny_backend, "tiny", None, ServeLimits(),
                                    adapters=AdapterShelf(tiny_adapters, make, capacity=1)))
    try:
        served = RolloutSettings(backend="openai", base_url=server.url, api_key_env=None)
        settings = EngineerSettings(engineer="policy", attempts=1, max_new_tokens=300, context="failures")
        current = EnvConfig(budget=10, sizes={3: SizeConfig(data_ratio=1.0)})
        result = engineer_config(Summary(stage=0), current, settings, PolicySettings(model=str(tiny_model_dir)), 0,
                                 str(tiny_adapters / "a1"), served=served)
    finally:
        server.stop()
    assert result.log["attempts"], result.log["notes"]
    raw = result.log["attempts"][0]["raw_output"]
    assert loaded == [(tiny_adapters / "a1").resolve()]  # the server loaded the stage's adapter: it was asked
    assert set(json.loads(raw)["sizes"]) == {"3"} and result.log["constrained"], result.log["attempts"]
