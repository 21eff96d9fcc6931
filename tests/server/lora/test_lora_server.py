"""LoRA adapters over HTTP with the official SDK: `model` names an adapter on every generating
route (completions, chat, responses, messages) and its tokens are transformers + peft's;
/v1/models lists adapters with their parent; adapters load and unload at run time, one in use
finishing under its adapter after the unload; an unknown adapter is the unknown model's 404;
every bad adapter a 400 naming the field, the server healthy after; the adapter gauge and
per-adapter counts at /metrics."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from transformers import AutoTokenizer

from config import ConfigError, ServerConfig
from engine.lora import LoRALoadError
from engine.stats import EngineStats, FinishedRequest
from server.app import attach_metrics, create_app
from server.metrics.collector import EngineMetrics
from server.metrics.names import MetricNames
from tests.support.lora import ALL_TARGETS, make_adapter, peft_greedy
from tests.support.models import build_random_model
from tests.support.server_harness import (
    RunningServer,
    assert_openai_error,
    chat_tokenizer_dir,
    scrape,
    start_engine,
    wait_until_idle,
)

MAX_NEW = 8
BASE = "tiny-llama"


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-http")
    return {
        "a": make_adapter(llama_dir, root / "a", 8, 16, ALL_TARGETS, seed=11),
        "b": make_adapter(llama_dir, root / "b", 4, 4, ["q_proj", "v_proj"], seed=12),
        "r32": make_adapter(llama_dir, root / "r32", 32, 16, ["q_proj"], seed=13),
    }


@pytest.fixture(scope="module")
def chat_dir(llama_dir: Path, tmp_path_factory) -> Path:
    return chat_tokenizer_dir(llama_dir, tmp_path_factory.mktemp("lora-chat-tokenizer"))


@pytest.fixture(scope="module")
def served(llama_dir, chat_dir, adapters):
    engine = start_engine(
        model=str(llama_dir),
        tokenizer=str(chat_dir),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=2,
        num_kv_blocks=64,
        block_size=16,
        max_model_len=128,
    )
    config = ServerConfig(
        served_model_name=[BASE],
        lora_modules=[f"a={adapters['a']}"],
        allow_runtime_lora_updating=True,
        responses_store="none",
    )
    metrics = attach_metrics(engine, config)
    server = RunningServer(engine, config, metrics)
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


PROMPT = "The lighthouse keeper had kept a logbook"
MESSAGES = [{"role": "user", "content": "Tell me about the lighthouse."}]


def test_models_list_the_adapter_with_its_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "a"}
    assert cards["a"].model_extra["parent"] == BASE
    assert cards["a"].model_extra["root"] == str(adapters["a"])
    assert cards[BASE].model_extra["parent"] is None
    assert client.models.retrieve("a").id == "a"


def test_every_generating_route_runs_the_adapter(served, client, llama_dir, chat_dir, adapters):
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False).input_ids
    (ref_a,) = peft_greedy(llama_dir, adapters["a"], [prompt_ids], MAX_NEW)
    (ref_base,) = peft_greedy(llama_dir, None, [prompt_ids], MAX_NEW)
    assert ref_a != ref_base

    def complete(model: str) -> str:
        out = client.completions.create(
            model=model, prompt=prompt_ids, max_tokens=MAX_NEW, temperature=0
        )
        assert out.model == model
        return out.choices[0].text

    assert complete("a") == _text(tokenizer, ref_a)
    assert complete(BASE) == _text(tokenizer, ref_base)

    # The conversation as the server renders it (its template is the chat tokenizer's).
    rendered = _post(served, "/tokenize", {"model": BASE, "messages": MESSAGES})
    (chat_ref,) = peft_greedy(llama_dir, adapters["a"], [rendered.json()["tokens"]], MAX_NEW)
    chat = client.chat.completions.create(
        model="a", messages=MESSAGES, max_tokens=MAX_NEW, temperature=0
    )
    assert chat.model == "a"
    assert chat.choices[0].message.content == _text(tokenizer, chat_ref)

    response = client.responses.create(
        model="a", input=MESSAGES[0]["content"], max_output_tokens=MAX_NEW, temperature=0
    )
    assert response.model == "a"
    assert response.output_text == _text(tokenizer, chat_ref)

    message = httpx.post(
        served.url + "/v1/messages",
        json={"model": "a", "messages": MESSAGES, "max_tokens": MAX_NEW, "temperature": 0},
        timeout=60,
    )
    assert message.status_code == 200, message.text
    assert message.json()["content"][0]["text"] == _text(tokenizer, chat_ref)


def test_unknown_adapter_is_the_unknown_model_404(client):
    for create in (
        lambda: client.completions.create(model="nope", prompt="x", max_tokens=1),
        lambda: client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=1),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            create()
        assert missing.value.body["code"] == "model_not_found"
        assert missing.value.body["param"] == "model"


def _post(served, route: str, body: dict) -> httpx.Response:
    return httpx.post(served.url + route, json=body, timeout=60)


def test_pooling_routes_do_not_take_an_adapter(served):
    """Pooling runs the base model only: an adapter's name there is an unknown model, not
    silently the base model's output."""
    for route, body in (
        ("/v1/embeddings", {"input": "x"}),
        ("/v1/score", {"text_1": "x", "text_2": "y"}),
        ("/v1/rerank", {"query": "x", "documents": ["y"]}),
    ):
        response = _post(served, route, {"model": "a", **body})
        assert response.status_code == 404, (route, response.text)
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model"), route


def test_load_and_unload_at_run_time_while_a_request_streams(
    served, client, llama_dir, chat_dir, adapters
):
    """b is loaded and a unloaded while a long stream runs under a: the stream finishes under
    a, with a's tokens; a new request for a is then a 404; a comes back with a reload."""
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False).input_ids
    long = 110  # the context's limit (128) less the prompt: the stream outlasts two calls
    (ref_long,) = peft_greedy(llama_dir, adapters["a"], [prompt_ids], long)
    (ref_b,) = peft_greedy(llama_dir, adapters["b"], [prompt_ids], MAX_NEW)
    started, pieces = threading.Event(), []

    def stream() -> None:
        for chunk in client.completions.create(
            model="a", prompt=prompt_ids, max_tokens=long, temperature=0, stream=True
        ):
            pieces.append(chunk.choices[0].text if chunk.choices else "")
            started.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert started.wait(60)
    loaded = _post(
        served, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])}
    )
    assert loaded.status_code == 200, loaded.text
    unloaded = _post(served, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert unloaded.status_code == 200, unloaded.text
    left = len(served.engine.engine.requests)  # (read across threads: a size, no more)
    assert left == 1, "the stream ended before the unload: nothing was in use"
    streaming.join(120)
    assert "".join(pieces) == _text(tokenizer, ref_long)

    assert {m.id for m in client.models.list().data} == {BASE, "b"}
    out = client.completions.create(model="b", prompt=prompt_ids, max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].text == _text(tokenizer, ref_b)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a", prompt=prompt_ids, max_tokens=1)
    again = _post(served, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert again.status_code == 404
    assert assert_openai_error(again.json())["param"] == "lora_name"
    reloaded = _post(
        served, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])}
    )
    assert reloaded.status_code == 200, reloaded.text
    state = wait_until_idle(served.engine)
    assert state.free_blocks == state.num_blocks


def _broken(adapters: dict[str, Path], tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (path, what the 400's message says)."""
    lm_head = Path(shutil.copytree(adapters["b"], tmp_path / "lm_head"))
    config = json.loads((lm_head / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "lm_head"]
    (lm_head / "adapter_config.json").write_text(json.dumps(config))
    corrupt = Path(shutil.copytree(adapters["b"], tmp_path / "corrupt"))
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(b"\x00" * 64)
    wide_model = build_random_model(
        tmp_path / "wide", "llama", "llama", vocab_size=512, hidden_size=96
    )
    wide = make_adapter(wide_model, tmp_path / "wide_adapter", 4, 4, ["q_proj"], seed=0)
    return {
        "missing": (str(tmp_path / "nowhere"), "no such folder"),
        "rank": (str(adapters["r32"]), "rank 32 is above --max-lora-rank 8"),
        "lm_head": (str(lm_head), "target modules ['lm_head']"),
        "corrupt": (str(corrupt), "not a readable safetensors file"),
        "wide": (str(wide), "does not fit this base model"),
    }


def test_bad_adapters_are_400s_and_the_server_stays_healthy(served, client, adapters, tmp_path):
    for name, (path, says) in _broken(adapters, tmp_path).items():
        response = _post(served, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert response.status_code == 400, (name, response.text)
        error = assert_openai_error(response.json())
        assert says in error["message"] and error["param"] == "lora_path", (name, error)
    for body, param in (
        ({"lora_name": "b", "lora_path": str(adapters["b"])}, "lora_name"),  # loaded already
        ({"lora_name": BASE, "lora_path": str(adapters["b"])}, "lora_name"),  # the base's name
        ({"lora_path": str(adapters["b"])}, "lora_name"),  # no name
    ):
        response = _post(served, "/v1/load_lora_adapter", body)
        assert response.status_code == 400, response.text
        assert assert_openai_error(response.json())["param"] == param
    assert httpx.get(served.url + "/health").status_code == 200
    assert {m.id for m in client.models.list().data} == {BASE, "a", "b"}
    assert client.completions.create(model="b", prompt="x", max_tokens=2).choices[0].text


def test_metrics_name_the_adapters(served):
    samples = scrape(served.url)
    info = [dict(labels) for name, labels in samples if name == "pagedserve:lora_requests_info"]
    assert len(info) == 1 and info[0]["max_lora"] == "2"
    counts = {
        dict(labels)["lora_name"]: value
        for (name, labels), value in samples.items()
        if name == "pagedserve:lora_requests_total"
    }
    # a was unloaded (after its stream ended) and loaded again with no request since: its
    # series went with the unload.
    assert "a" not in counts and counts["b"] >= 2


def test_vllm_gauge_follows_running_and_waiting_adapters():
    metrics = EngineMetrics(CollectorRegistry(), BASE, 16, 64, 128, MetricNames("vllm"), 4)
    metrics.record(EngineStats(running_loras=["a", "b"], waiting_loras=["c"]))
    metrics.record(EngineStats(running_loras=["b"], waiting_loras=[], finished=[_done("b")]))
    text = generate_latest(metrics.registry).decode()
    series = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(series) == 1, series  # the previous state's series is gone
    assert 'max_lora="4"' in series[0] and 'running_lora_adapters="b"' in series[0]
    assert 'waiting_lora_adapters=""' in series[0] and 'engine="0"' in series[0]
    assert (
        'pagedserve:lora_requests_total{engine="0",lora_name="b",model_name="tiny-llama"} 1.0'
        in text
    )


def test_an_unloaded_adapters_request_count_goes_away():
    metrics = EngineMetrics(CollectorRegistry(), BASE, 16, 64, 128, MetricNames("pagedserve"), 4)
    metrics.record(EngineStats(finished=[_done("a"), _done("b")]))
    # b's last request and its unload in one snapshot: counted, then removed; c never finished.
    metrics.record(EngineStats(finished=[_done("b")], unloaded_loras=["b", "c"]))
    text = generate_latest(metrics.registry).decode()
    series = [line for line in text.splitlines() if line.startswith("pagedserve:lora_requests_")]
    assert [line for line in series if "_total{" in line] == [
        'pagedserve:lora_requests_total{lora_name="a",model_name="tiny-llama"} 1.0'
    ]


def _done(name: str) -> FinishedRequest:
    return FinishedRequest("stop", 3, 2, 0.1, 0.0, 0.05, 0.05, lora_name=name)


def test_adapters_on_the_command_line_need_lora(llama_dir, adapters):
    with pytest.raises(ValueError, match="expected name=path"):
        ServerConfig(lora_modules=["just-a-name"])
    with pytest.raises(ValueError, match="more than one adapter"):
        ServerConfig(lora_modules=[f"a={adapters['a']}", f"a={adapters['b']}"])
    engine = start_engine(model=str(llama_dir), num_kv_blocks=16, max_model_len=64)
    try:
        with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
            create_app(engine, ServerConfig(lora_modules=[f"a={adapters['a']}"]))
    finally:
        engine.shutdown()


def test_a_bad_adapter_on_the_command_line_stops_the_start(llama_dir, adapters):
    """The app's start-up (its lifespan) reads every --lora-modules adapter: a rank above the
    slots' is the start-up's error, before any request is served."""
    engine = start_engine(
        model=str(llama_dir), num_kv_blocks=16, max_model_len=64, enable_lora=True
    )
    try:
        app = create_app(engine, ServerConfig(lora_modules=[f"big={adapters['r32']}"]))
        refused = pytest.raises(LoRALoadError, match="rank 32 is above --max-lora-rank 16")
        with refused as bad, TestClient(app):
            pass
        assert bad.value.param == "lora_path"
    finally:
        engine.shutdown()
