"""`pagedserve serve`: every flag documented, settings merged from flag > environment > config
file > default, bad settings refused before any model loads, and the README's curl and SDK
examples (also those of docs/openai-api.md) run as written against the real command serving the
default model."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, EngineConfig, ModelConfig
from config.engine_config import flag
from config.sources import SERVE_SECTIONS, serve_config
from server import cli
from tests.support.readme import code_blocks
from tests.support.readme import section as doc_section
from tests.support.server_harness import free_port, wait_until_answering


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--help"])
    assert info.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, even inside words
    for section in SERVE_SECTIONS.values():
        for name, field in section.model_fields.items():
            if name == "model":
                continue  # the positional MODEL
            assert flag(name) in text, name
            assert "".join(str(field.description).split()) in text, name
            assert f"PAGEDSERVE_{name.upper()}" in text, name
    assert "--config" in text and "[model]" in text


def test_flag_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text("max-num-seqs: 8\nport: 9001\nblock_size: 32\nserved-model-name: [a, b]\n")
    env = {
        "PAGEDSERVE_MAX_NUM_SEQS": "16",
        "PAGEDSERVE_PORT": "9002",
        "PAGEDSERVE_ALLOWED_ORIGINS": "http://x,http://y",
    }
    config = serve_config({"port": 9003}, env, path)
    assert config.server.port == 9003  # flag over environment and file
    assert config.engine.scheduler.max_num_seqs == 16  # environment over file
    assert config.engine.cache.block_size == 32  # file over default
    assert config.server.served_model_name == ["a", "b"]
    assert config.server.allowed_origins == ["http://x", "http://y"]
    assert config.engine.scheduler.max_num_batched_tokens == 2048  # default
    assert config.server.metrics_names == "pagedserve"  # default: our own names
    assert serve_config({}, {"PAGEDSERVE_METRICS_NAMES": "vllm"}).server.metrics_names == "vllm"


def test_tool_call_parser_defaults_to_auto_and_the_vllm_flag_is_taken() -> None:
    assert serve_config({}, {}).server.tool_call_parser == "auto"
    args = vars(cli.build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))
    args.pop("command"), args.pop("config")
    config = serve_config(args, {})
    assert config.server.enable_auto_tool_choice is True  # accepted, and nothing reads it
    assert config.server.tool_call_parser == "auto"
    named = vars(cli.build_parser().parse_args(["serve", "--tool-call-parser", "generic"]))
    assert named["tool_call_parser"] == "generic"
    field = SERVE_SECTIONS["server"].model_fields["enable_auto_tool_choice"]
    assert "does nothing" in str(field.description)


def test_hub_settings_from_flags_environment_file_and_kwargs(tmp_path: Path) -> None:
    argv = ["serve", "Qwen/Qwen3-0.6B", "--revision", "v2", "--download-dir", str(tmp_path)]
    args = vars(cli.build_parser().parse_args([*argv, "--tokenizer", "org/tok"]))
    del args["command"], args["config"]
    model = serve_config(args, {}).engine.model
    assert (model.model, model.tokenizer) == ("Qwen/Qwen3-0.6B", "org/tok")
    assert (model.revision, model.download_dir) == ("v2", tmp_path)
    env = {"PAGEDSERVE_REVISION": "0" * 40, "PAGEDSERVE_DOWNLOAD_DIR": "/hf/cache"}
    model = serve_config({}, env).engine.model
    assert (model.revision, model.download_dir) == ("0" * 40, Path("/hf/cache"))
    path = tmp_path / "settings.yaml"
    path.write_text("revision: main\ndownload-dir: /models/hf\n")
    model = serve_config({}, {}, path).engine.model
    assert (model.revision, model.download_dir) == ("main", Path("/models/hf"))
    model = EngineConfig.from_kwargs(model="org/name", revision="v1", download_dir="/d").model
    assert (model.model, model.revision, model.download_dir) == ("org/name", "v1", Path("/d"))
    assert (ModelConfig().revision, ModelConfig().download_dir) == (None, None)  # main, HF's cache
    with pytest.raises(ConfigError, match="--revision"):
        serve_config({"revision": ""}, {})


@pytest.mark.parametrize(
    ("cli_settings", "env", "file_text", "words"),
    [
        ({"max_num_seqs": 0}, {}, None, ["--max-num-seqs", ">= 1"]),
        ({}, {"PAGEDSERVE_PORT": "eighty"}, None, ["--port", "integer"]),
        (
            {},
            {},
            "max-num-sequences: 4\n",
            ["max-num-sequences", "unknown setting", "max_num_seqs"],
        ),
        ({}, {}, "- just\n- a list\n", ["expected a mapping"]),
        ({}, {"PAGEDSERVE_METRICS_NAMES": "prom"}, None, ["--metrics-names", "'vllm'"]),
        ({}, {}, "port: [\n", ["cannot read"]),
        # vLLM's JSON flag: bad JSON, an unknown key, a bad value, from each source.
        (
            {"kv_events_config": '{"enable_kv_cache_events": tru'},
            {},
            None,
            ["--kv-events-config", "not valid JSON"],
        ),
        (
            {},
            {"PAGEDSERVE_KV_EVENTS_CONFIG": '{"enable_kv_cache_events": true, "port": 5557}'},
            None,
            ["--kv-events-config", "unknown key 'port'", "endpoint"],
        ),
        ({}, {}, "kv-events-config: {hwm: -1}\n", ["--kv-events-config", "'hwm'", "-1"]),
    ],
)
def test_bad_settings_name_their_flag(
    tmp_path: Path,
    cli_settings: dict[str, object],
    env: dict[str, str],
    file_text: str | None,
    words: list[str],
) -> None:
    path = None
    if file_text is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(file_text)
    with pytest.raises(ConfigError) as info:
        serve_config(cli_settings, env, path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_serve_refuses_bad_flags_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--block-size", "24"]) == 2
    assert "--block-size" in capsys.readouterr().err
    assert cli.main(["serve", "--kv-events-config", "{oops"]) == 2
    assert "--kv-events-config: Value error, not valid JSON" in capsys.readouterr().err


def test_docs_kv_events_command_resolves_to_vllms_settings() -> None:
    """The --kv-events-config example of docs/deployment.md is what the server would publish with."""
    text = doc_section("KV cache events for prefix-aware routers", page="deployment.md")
    (command,) = code_blocks(text, "bash")
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:2] == ["pagedserve", "serve"]
    args = vars(cli.build_parser().parse_args(argv[1:]))
    args.pop("command")
    config = serve_config(args, {}, args.pop("config"))
    events = config.engine.cache.kv_events_config
    assert events is not None and events.enabled and events.publisher == "zmq"
    assert (events.endpoint, events.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    assert events.topic == "kv@10.0.0.7:8000@my-model"
    assert config.engine.cache.block_size == 64 and config.server.metrics_names == "vllm"


def test_docs_speculative_commands_resolve_to_vllms_settings() -> None:
    """The two --speculative-config examples of docs/speculative-decoding.md parse into the
    methods they name."""
    text = doc_section("Speculative decoding", page="speculative-decoding.md")
    (block,) = code_blocks(text, "bash")
    methods = []
    for command in block.strip().splitlines():
        argv = shlex.split(command)
        assert argv[:2] == ["pagedserve", "serve"]
        args = vars(cli.build_parser().parse_args(argv[1:]))
        args.pop("command")
        spec = serve_config(args, {}, args.pop("config")).engine.scheduler.speculative_config
        assert spec is not None and spec.num_speculative_tokens == 4
        methods.append((spec.method, spec.model, spec.prompt_lookup_min, spec.prompt_lookup_max))
    assert methods == [("ngram", None, 2, 5), ("draft_model", "/models/draft", None, None)]


# --------------------------------------------------------------------------- the README, for real


def _readme_blocks(language: str, marker: str, page: str = "README.md") -> list[str]:
    """The examples of "Talking to the server" in the README, or of docs/openai-api.md."""
    heading = "Talking to the server" if page == "README.md" else "The OpenAI API"
    blocks = code_blocks(doc_section(heading, page), language)
    return [b for b in blocks if marker in b]


def test_readme_examples_run_against_pagedserve_serve(
    default_model_dir: Path, tmp_path: Path
) -> None:
    curls = _readme_blocks("bash", "curl ")
    snippets = _readme_blocks("python", "from openai import OpenAI")
    assert len(curls) == 2 and len(snippets) == 1
    # The docs page opens with the same examples, so that what it shows is run here too.
    assert _readme_blocks("bash", "curl ", "openai-api.md") == curls
    assert _readme_blocks("python", "from openai import OpenAI", "openai-api.md")[:1] == snippets
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = Path(sys.executable).parent / "pagedserve"
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [
            str(command),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-kv-blocks",
            "512",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        wait_until_answering(url + "/health", process, tmp_path / "serve.log", timeout=180)

        def run(argv: list[str]) -> str:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stderr
            return done.stdout

        completion = json.loads(run(["bash", "-c", curls[0].replace("http://localhost:8000", url)]))
        assert (
            completion["object"] == "text_completion" and completion["choices"][0]["text"].strip()
        )
        assert completion["usage"]["completion_tokens"] <= 16

        stream = run(["bash", "-c", curls[1].replace("http://localhost:8000", url)])
        assert stream.endswith("data: [DONE]\n\n")
        chunks = [json.loads(e[len("data: ") :]) for e in stream.split("\n\n")[:-2]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).strip()

        printed = run([sys.executable, "-c", snippets[0].replace("http://localhost:8000", url)])
        lines = printed.strip().splitlines()
        assert len(lines) >= 2 and lines[0].strip() and lines[-1].strip()

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    assert os.path.exists(tmp_path / "serve.log")
