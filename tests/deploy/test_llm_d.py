"""The llm-d manifests (deploy/llm-d/) agree with each other and with the server's flags:
what the pool selects is what the pods carry, the ports the picker dials are the ports the
server opens, the picker's block size is the server's, the pods' environment resolves to a
server config that publishes KV events where the picker listens. Static checks only: nothing
here runs on a cluster."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from config.sources import serve_config

LLM_D = Path(__file__).resolve().parents[2] / "deploy" / "llm-d"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((LLM_D / name).read_text(encoding="utf-8"))
    return data


def pod() -> dict[str, Any]:
    return load("pagedserve.yaml")["spec"]["template"]


def server_container() -> dict[str, Any]:
    [c] = pod()["spec"]["containers"]
    return c


def expanded_env(container: dict[str, Any], values: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: `$(NAME)` replaced by an earlier
    variable's value (fieldRef ones taken from `values`)."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
        else:
            env[item["name"]] = values[item["name"]]
    return env


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def picker_config() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(
        load("endpoint-picker-config.yaml")["data"]["epp-config.yaml"]
    )
    return data


def plugin(config: dict[str, Any], kind: str) -> dict[str, Any]:
    [found] = [p for p in config["plugins"] if p["type"] == kind]
    return found


def test_api_versions_and_kinds() -> None:
    assert {
        (load(n)["apiVersion"], load(n)["kind"])
        for n in (
            "pagedserve.yaml",
            "inferencepool.yaml",
            "httproute.yaml",
            "endpoint-picker.yaml",
            "endpoint-picker-service.yaml",
        )
    } == {
        ("apps/v1", "Deployment"),
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"),
        ("v1", "Service"),
    }
    assert picker_config()["kind"] == "EndpointPickerConfig"


def test_the_pool_selects_the_pods_on_the_port_the_server_listens_on() -> None:
    labels = pod()["metadata"]["labels"]
    pool = load("inferencepool.yaml")["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    deployment = load("pagedserve.yaml")["spec"]
    assert deployment["selector"]["matchLabels"].items() <= labels.items()
    # vLLM-like: the picker reads vLLM's metric names from these pods.
    assert (
        labels["llm-d.ai/engine-type"]
        == labels["inference.networking.k8s.io/engine-type"]
        == "vllm"
    )
    assert labels["llm-d.ai/role"] == "decode"
    config = serve_config({}, expanded_env(server_container(), {"POD_IP": "10.0.0.7"}))
    [target] = pool["targetPorts"]
    assert target["number"] == config.server.port == ports(server_container())["http"]
    assert config.server.host == "0.0.0.0"
    assert config.server.metrics_names == "vllm"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert server_container()[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_kv_events_are_published_where_the_picker_dials_with_its_block_size() -> None:
    config = serve_config({}, expanded_env(server_container(), {"POD_IP": "10.0.0.7"}))
    events = config.engine.cache.kv_events_config
    assert events is not None and events.enabled and events.wire_format == "array"
    assert config.engine.cache.enable_prefix_caching
    scorer = plugin(picker_config(), "precise-prefix-cache-scorer")["parameters"]
    kv = scorer["kvEventsConfig"]
    # Pod discovery: every pod binds, the picker dials each one at socketPort.
    assert kv["discoverPods"] is True
    assert events.endpoint == f"tcp://*:{kv['podDiscoveryConfig']['socketPort']}"
    assert kv["podDiscoveryConfig"]["socketPort"] == ports(server_container())["kv-events"]
    # The topic names the pod by its inference endpoint and the model, as llm-d parses it.
    served = config.server.served_model_name
    assert served is not None
    assert events.topic == f"kv@10.0.0.7:{config.server.port}@{served[0]}"
    assert events.topic.startswith(kv["topicFilter"])
    assert scorer["tokenProcessorConfig"]["blockSize"] == config.engine.cache.block_size
    assert scorer["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == served[0]
    assert plugin(picker_config(), "tokenizer")["parameters"]["modelName"] == served[0]


def test_the_picker_scores_prefix_cache_and_load_and_every_reference_resolves() -> None:
    config = picker_config()
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    [profile] = config["schedulingProfiles"]
    refs = [p["pluginRef"] for p in profile["plugins"]]
    assert set(refs) <= names
    for source in config["dataLayer"]["sources"]:
        assert {source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])} <= names
    weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    for scorer in ("precise-prefix-cache-scorer", "kv-cache-utilization-scorer", "queue-scorer"):
        assert weights[scorer] and weights[scorer] > 0
    assert refs[-1] == "max-score-picker"


def test_the_picker_deployment_serves_the_pool_the_route_names() -> None:
    pool = load("inferencepool.yaml")
    ref = pool["spec"]["endpointPickerRef"]
    service = load("endpoint-picker-service.yaml")
    epp = load("endpoint-picker.yaml")["spec"]["template"]
    [container] = epp["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert ref["kind"] == "Service" and ref["name"] == service["metadata"]["name"]
    [grpc] = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert ports(container)[grpc["targetPort"]] == int(args["grpc-port"])
    assert service["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args["pool-group"] == pool["apiVersion"].split("/")[0]
    assert ports(container)["grpc-health"] == int(args["grpc-health-port"])
    # The config file is the ConfigMap's key, mounted where the argument says.
    [mount] = container["volumeMounts"]
    [volume] = [v for v in epp["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = load("endpoint-picker-config.yaml")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert Path(args["config-file"]).parent == Path(mount["mountPath"])
    assert Path(args["config-file"]).name in config_map["data"]
    # It runs as the account the Role is bound to, which may watch pools and pods.
    rbac = {item["kind"]: item for item in load("endpoint-picker-rbac.yaml")["items"]}
    assert epp["spec"]["serviceAccountName"] == rbac["ServiceAccount"]["metadata"]["name"]
    assert rbac["RoleBinding"]["subjects"][0]["name"] == rbac["ServiceAccount"]["metadata"]["name"]
    assert rbac["RoleBinding"]["roleRef"]["name"] == rbac["Role"]["metadata"]["name"]
    granted = {
        (g, r)
        for rule in rbac["Role"]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= granted
    # The route sends its traffic to the pool.
    [rule] = load("httproute.yaml")["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
