"""Models named by a Hugging Face repo id: huggingface_hub itself downloads a tiny random model
from a fake Hub on 127.0.0.1 (tests/support/fake_hub.py) into a temporary hub cache, then, with the
server gone and HF_HUB_OFFLINE=1, the engine loads it from that cache and generates the same
greedy tokens as from the model's own folder. `--revision` picks another commit's files; gated,
missing, remote-code and pickle-only repos, a missing revision, an uncached model offline and an
unreachable Hub each fail with a message saying what to do; an existing folder wins over a repo.

huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE at import, so each of the three settings
(online, offline, no network) runs in a fresh process (tests/support/hub_client.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from config import ModelConfig
from engine import ModelLoadError
from engine.loading.hub import is_repo_id
from engine.loading.resolve import resolve_model_path
from tests.support.fake_hub import FakeHub, FakeRepo, read_folder
from tests.support.models import build_random_model

ROOT = Path(__file__).resolve().parents[3]
CLIENT_TIMEOUT_S = 120  # far above what a run takes; a hang fails instead of waiting forever
PROMPT = "The cat sat on the mat"  # hub_client's first prompt
VOCAB = 16384  # the Qwen tokenizer's first ids: small weights, and common words still encode

REPO = "pagedserve-test/tiny-qwen3"
GATED = "pagedserve-test/gated-model"
REMOTE = "pagedserve-test/remote-code"
BIN_ONLY = "pagedserve-test/bin-only"
MISSING = "pagedserve-test/no-such-model"
NEVER = "pagedserve-test/never-downloaded"

C1 = hashlib.sha1(b"commit one").hexdigest()
C2 = hashlib.sha1(b"commit two").hexdigest()
# Files a snapshot must not contain: other weight formats, and weights in subfolders.
DECOYS = {
    "pytorch_model.bin": b"a pickle pagedserve never loads",
    "original/consolidated.safetensors": b"another layout of the same weights",
    "onnx/model.onnx": b"onnx",
    "README.md": b"# tiny\n",
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
}
REMOTE_CONFIG = {
    "architectures": ["TinyCustomForCausalLM"],
    "model_type": "tiny_custom",
    "auto_map": {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
    },
}


@dataclass
class Hub:
    v1: Path  # the model at commit C1 (main, tag v1): a sharded checkpoint
    v2: Path  # at commit C2 (branch v2): another seed, one file
    cache: Path
    url: str  # dead once the downloads are done
    online: list[dict[str, object]]
    fetched: list[str]  # files the fake Hub sent


def run_client(steps: list[dict[str, object]], **env: str) -> list[dict[str, object]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    clean.update(
        PYTHONPATH=str(ROOT),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_XET="1",
        **env,
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.hub_client", json.dumps(steps)],
        env=clean,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads(line[7:]) for line in done.stdout.splitlines() if line[:7] == "RESULT "]
    assert len(results) == len(steps), done.stdout + done.stderr[-4000:]
    return results


def _repos(v1: Path, v2: Path) -> dict[str, FakeRepo]:
    config = (v1 / "config.json").read_bytes()
    tokenizer = {k: v for k, v in read_folder(v1).items() if k.startswith(("tok", "vocab", "merg"))}
    return {
        REPO: FakeRepo(
            commits={C1: {**read_folder(v1), **DECOYS}, C2: {**read_folder(v2), **DECOYS}},
            refs={"main": C1, "v1": C1, "v2": C2},
        ),
        GATED: FakeRepo(commits={C1: read_folder(v1)}, refs={"main": C1}, gated=True),
        REMOTE: FakeRepo(
            commits={
                C1: {
                    "config.json": json.dumps(REMOTE_CONFIG).encode(),
                    "modeling_tiny.py": b"raise SystemExit('remote code ran')\n",
                    "model.safetensors": b"never fetched",
                }
            },
            refs={"main": C1},
        ),
        BIN_ONLY: FakeRepo(
            commits={C1: {"config.json": config, **tokenizer, "pytorch_model.bin": b"a pickle"}},
            refs={"main": C1},
        ),
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """Both models downloaded (and every error case tried) online; the fake Hub then stopped."""
    root = tmp_path_factory.mktemp("hub")
    v1 = build_random_model(root / "v1", "qwen3", "qwen", seed=1, shard=True, vocab_size=VOCAB)
    v2 = build_random_model(root / "v2", "qwen3", "qwen", seed=2, vocab_size=VOCAB)
    assert (v1 / "model.safetensors.index.json").is_file()  # both weight layouts are covered
    cache = root / "hf-cache"
    fake = FakeHub(_repos(v1, v2)).start()
    try:
        on = {"download_dir": str(cache)}
        online = run_client(
            [
                {"do": "resolve", "model": REPO, **on},
                {"do": "resolve", "model": REPO, "revision": "v2", **on},
                {"do": "resolve", "model": REPO, "revision": C1, **on},
                {"do": "tokenizer", "model": str(v2), "tokenizer": REPO, **on},
                {"do": "resolve", "model": GATED, **on},
                {"do": "resolve", "model": MISSING, **on},
                {"do": "resolve", "model": REPO, "revision": "no-such-branch", **on},
                {"do": "resolve", "model": REMOTE, **on},
                {"do": "resolve", "model": BIN_ONLY, **on},
            ],
            HF_ENDPOINT=fake.url,
            HF_HOME=str(root / "hf-home"),
        )
    finally:
        fake.stop()
    yield Hub(v1, v2, cache, fake.url, online, fake.fetched())


def test_download_lays_out_the_hub_cache(hub: Hub) -> None:
    main, v2, by_commit, tokenizer = (r["path"] for r in hub.online[:4])
    repo = hub.cache / "models--pagedserve-test--tiny-qwen3"
    assert main == by_commit == str(repo / "snapshots" / C1)
    assert v2 == str(repo / "snapshots" / C2)
    assert tokenizer == main  # a tokenizer repo id: the same revision, main
    assert (repo / "refs" / "main").read_text() == C1
    assert (repo / "refs" / "v2").read_text() == C2
    for commit, model in ((C1, hub.v1), (C2, hub.v2)):
        snapshot = repo / "snapshots" / commit
        files = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
        assert files == sorted(p.name for p in model.iterdir())  # config, tokenizer, weights
        for name in files:  # links into blobs/, as huggingface_hub lays them out
            assert (snapshot / name).is_symlink()
            assert (snapshot / name).resolve().parent == repo / "blobs"
            assert (snapshot / name).read_bytes() == (model / name).read_bytes()
    sent = {path.rsplit("/", 1)[-1] for path in hub.fetched}
    assert not sent & {"pytorch_model.bin", "consolidated.safetensors", "model.onnx", "README.md"}
    remote = [p for p in hub.fetched if p.startswith("/" + REMOTE)]
    assert remote == [f"/{REMOTE}/resolve/{C1}/config.json"]  # refused before its weights


@pytest.mark.parametrize(
    ("index", "words"),
    [
        (4, ["gated", GATED, "accept its licence", "HF_TOKEN"]),
        (5, [MISSING, "neither a local folder nor a model repo", "check the name"]),
        (6, ["no revision 'no-such-branch'", "--revision"]),
        (7, ["remote code", "TinyCustomForCausalLM", "auto_map", "does not run remote code"]),
        (8, ["no safetensors weights", "--revision", ".bin"]),
    ],
)
def test_hub_errors_say_what_to_do(hub: Hub, index: int, words: list[str]) -> None:
    result = hub.online[index]
    assert set(result) == {"error"}, result
    for word in words:
        assert word in str(result["error"]), (word, result["error"])


@pytest.fixture(scope="module")
def offline(hub: Hub) -> list[dict[str, object]]:
    on = {"download_dir": str(hub.cache)}
    cli = ["generate", REPO, "--revision", "v2", "--download-dir", str(hub.cache)]
    cli += ["--prompt", PROMPT, "--max-tokens", "8", "--num-kv-blocks", "32"]
    cli += ["--max-model-len", "128", "--attention-backend", "torch", "--enforce-eager"]
    return run_client(
        [
            {"do": "generate", "model": REPO, "tokenizer": REPO, **on},
            {"do": "generate", "model": str(hub.v1)},
            {"do": "cli", "argv": cli},
            {"do": "generate", "model": str(hub.v2), "tokenizer": REPO, **on},
            {"do": "resolve", "model": NEVER, **on},
            {"do": "resolve", "model": REPO, "revision": "v1", **on},  # a ref never fetched
        ],
        HF_ENDPOINT=hub.url,  # nothing listens there any more
        HF_HUB_OFFLINE="1",
        HF_HOME=str(hub.cache.parent / "hf-home"),
    )


def test_offline_repo_id_generates_what_the_folder_does(hub: Hub, offline: list[dict]) -> None:
    from_hub, from_folder = offline[:2]
    assert from_hub["tokens"] == from_folder["tokens"]
    assert from_hub["texts"] == from_folder["texts"]
    assert from_hub["model"] == REPO  # the name clients use, as vLLM serves it
    assert from_hub["model_path"] == str(
        hub.cache / "models--pagedserve-test--tiny-qwen3" / "snapshots" / C1
    )
    assert from_hub["vocab"] == from_folder["vocab"]


def test_cli_revision_generates_what_that_commit_does(offline: list[dict]) -> None:
    """`pagedserve generate org/name --revision v2 --download-dir DIR`, offline, writes what the
    v2 folder (with the repo's tokenizer) generates, and not what main's weights do."""
    from_folder, cli, v2_folder = offline[1:4]
    assert cli["status"] == 0, cli
    assert f"\n{v2_folder['texts'][0]}\n[finish_reason=length]" in cli["out"], cli["out"]
    assert v2_folder["tokens"] != from_folder["tokens"]  # the two commits' weights differ


def test_offline_without_the_model_in_cache(hub: Hub, offline: list[dict]) -> None:
    for result, what in ((offline[4], NEVER), (offline[5], "revision 'v1'")):
        message = str(result.get("error"))
        assert what in message and str(hub.cache) in message, result
        assert "not (completely) in the Hugging Face cache" in message
        assert "unset HF_HUB_OFFLINE" in message


def test_unreachable_hub(hub: Hub) -> None:
    """Online with no Hub to answer: a cached model still loads, as with transformers; an
    uncached one fails naming the Hub it could not reach."""
    cached, missing = run_client(
        [
            {"do": "resolve", "model": REPO, "download_dir": str(hub.cache)},
            {"do": "resolve", "model": NEVER, "download_dir": str(hub.cache)},
        ],
        HF_ENDPOINT=hub.url,
        HF_HOME=str(hub.cache.parent / "hf-home"),
    )
    assert cached == {"path": str(hub.cache / "models--pagedserve-test--tiny-qwen3/snapshots" / C1)}
    message = str(missing.get("error"))
    assert "cannot reach the Hugging Face Hub at " + hub.url in message, missing
    assert "check the network" in message


def test_an_existing_folder_wins_over_a_repo_id(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(hub.v2, tmp_path / REPO)
    monkeypatch.chdir(tmp_path)
    # No Hub is asked: this process's huggingface_hub points at the real one.
    assert resolve_model_path(ModelConfig(model=REPO, revision="v1")) == Path(REPO)


@pytest.mark.parametrize("name", ["no-such-folder", "./no/such/folder", "~/no-such/x", "a/b/c"])
def test_neither_folder_nor_repo_id(name: str) -> None:
    assert not is_repo_id(name)
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path(ModelConfig(model=name))
    assert "does not exist" in str(info.value) and name in str(info.value)


def test_repo_id_shape() -> None:
    assert is_repo_id("Qwen/Qwen3-0.6B") and is_repo_id("org/name.v2")
    assert not any(map(is_repo_id, ["gpt2", "/abs/path", "org/na--me", "org/x.git", "../x"]))
