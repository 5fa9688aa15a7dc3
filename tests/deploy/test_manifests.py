"""deploy/kubernetes renders with `kubectl kustomize` into objects that validate: Kubernetes's own
kinds with kubernetes-validate --strict, the custom resources against the JSON Schemas in
deploy/kubernetes/schemas/; and what the issue names holds in every rendering (probe paths, the
grace period past the drain, the engine-type label, the GPU overlay, the config file)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from engine.kv_events import DEFAULT_SEED, binds, parse_kv_events_config
from engine.prefix_cache import DEFAULT_BLOCK
from gateway.config import OPTIONS, from_args
from gateway.models.config_file import load_config

from .manifests import CUSTOM, K8S, TARGETS, config_file, container, env, epp_config, one, parse_spec, render, schema

# The oldest Kubernetes the manifests promise to work on, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
KNOB_BY_ENV = {k.env: k for k in OPTIONS.values()}
FERRY_SERIES = {"ferry_queue_depth", "ferry_running_sequences", "ferry_kv_cache_usage_ratio"}


def _is_builtin(doc: dict[str, Any]) -> bool:
    return doc["kind"] not in CUSTOM


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate_strictly(target, version):
    docs = [d for d in render(target) if _is_builtin(d)]
    assert {d["kind"] for d in docs} >= {"Namespace", "Deployment", "Service", "ConfigMap"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_a_field_kubernetes_does_not_know():
    """The check above is not vacuous: a misspelt field fails it."""
    deployment = copy.deepcopy(one(render("base"), "Deployment", "ferry"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_custom_resources_match_their_schemas(target):
    docs = render(target)
    seen = set()
    for doc in docs:
        if doc["kind"] in CUSTOM:
            jsonschema.validate(doc, schema(CUSTOM[doc["kind"]]))
            seen.add(doc["kind"])
    assert seen >= {"InferencePool", "HTTPRoute", "PodMonitor"}
    jsonschema.validate(epp_config(docs), schema("endpointpickerconfig"))


@pytest.mark.parametrize(
    ("kind", "break_it"),
    [
        ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].pop("port")),  # a Service ref needs its port
        ("InferencePool", lambda d: d["spec"]["targetPorts"].append({"number": 8001})),  # one port at most
        ("HTTPRoute", lambda d: d["spec"]["rules"][0]["timeouts"].update(request="10 minutes")),
        ("PodMonitor", lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="5 s")),
        ("ScaledObject", lambda d: d["spec"]["triggers"][0]["metadata"].pop("query")),
        ("ScaledObject", lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=8)),  # must be a string
    ],
)
def test_the_schemas_reject_a_broken_resource(kind, break_it):
    doc = copy.deepcopy(one(render("overlays/gpu"), kind))
    break_it(doc)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema(CUSTOM[kind]))


@pytest.mark.parametrize("target", TARGETS)
def test_probes(target):
    c = container(render(target))
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # Model loading: /readyz turns 200 only once the models are loaded and warm.
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/readyz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "less than 5 minutes to load the models"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    assert ports["http"] == OPTIONS["port"].parse(env(render(target))["FERRY_PORT"]["value"])


@pytest.mark.parametrize("target", TARGETS)
def test_grace_period_outlasts_the_prestop_hook_and_the_drain(target):
    docs = render(target)
    pod = one(docs, "Deployment", "ferry")["spec"]["template"]["spec"]
    c = container(docs)
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    drain = OPTIONS["drain_timeout"].parse(env(docs)["FERRY_DRAIN_TIMEOUT"]["value"])
    # SIGTERM (and so the drain) starts only after the preStop hook has returned.
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain


@pytest.mark.parametrize("target", TARGETS)
def test_environment_names_are_ferry_knobs_and_secrets_come_from_a_secret(target):
    variables = env(render(target))
    # Kubernetes expands $(NAME) in a value from the variables before it: the pod's own facts
    # (downward API) that a knob's value names may be there beside the knobs.
    referenced = {n for e in variables.values() for n in re.findall(r"\$\((\w+)\)", e.get("value", ""))}
    for name, e in variables.items():
        if name in referenced and name not in KNOB_BY_ENV:
            assert "fieldRef" in e["valueFrom"], f"{name}: a helper variable comes from the downward API"
            continue
        assert name in KNOB_BY_ENV, f"{name} is not the environment name of any `ferry serve` knob"
        if "value" in e:
            KNOB_BY_ENV[name].parse(e["value"])  # a value the server accepts
    for knob in ("api_keys", "admin_token"):
        ref = variables[OPTIONS[knob].env]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "ferry-secrets"
    assert not any(d["kind"] == "Secret" for d in render(target)), "credentials must not be shipped"


@pytest.mark.parametrize("target", TARGETS)
def test_replicas_publish_kv_events_where_the_pickers_scorer_listens(target):
    """Each replica connects to the picker's collector with the topic llm-d parses
    (kv@<pod ip>@<model>), the model its config serves; the scorer hashes blocks of Ferry's
    size with vLLM's default seed, which Ferry uses while PYTHONHASHSEED is unset."""
    docs = render(target)
    variables = env(docs)
    config = parse_kv_events_config(variables["FERRY_KV_EVENTS_CONFIG"]["value"].replace("$(POD_IP)", "10.1.2.3"))
    assert config is not None and config.enabled and not binds(config.endpoint)
    chat = [m["name"] for m in yaml.safe_load(config_file(docs)[1])["models"] if m["kind"] == "chat"]
    assert config.topic == f"kv@10.1.2.3@{chat[0]}" and len(chat) == 1
    assert variables["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "PYTHONHASHSEED" not in variables
    scorer = next(p for p in epp_config(docs)["plugins"] if p["type"] == "precise-prefix-cache-scorer")["parameters"]
    assert scorer["tokenProcessorConfig"] == {"blockSize": DEFAULT_BLOCK, "hashSeed": DEFAULT_SEED}
    assert scorer["kvEventsConfig"]["zmqEndpoint"].endswith(":" + config.endpoint.rsplit(":", 1)[1])
    assert config.topic.startswith(scorer["kvEventsConfig"]["topicFilter"])
    assert scorer["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == chat[0]


@pytest.mark.parametrize("target", TARGETS)
def test_pods_carry_the_engine_type_and_every_selector_finds_them(target):
    docs = render(target)
    deployment = one(docs, "Deployment", "ferry")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["llm-d.ai/engine-type"] == "ferry"
    selectors = {
        "Deployment": deployment["spec"]["selector"]["matchLabels"],
        "Service": one(docs, "Service", "ferry")["spec"]["selector"],
        "InferencePool": one(docs, "InferencePool")["spec"]["selector"]["matchLabels"],
        "PodMonitor": one(docs, "PodMonitor")["spec"]["selector"]["matchLabels"],
    }
    for kind, selector in selectors.items():
        assert selector.items() <= labels.items(), f"the {kind} selects no Ferry pod"
    pool = one(docs, "InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": container(docs)["ports"][0]["containerPort"]}]
    extractor = _extractor(epp_config(docs))
    assert extractor["engineLabelKey"] == "llm-d.ai/engine-type"
    assert labels[extractor["engineLabelKey"]] in {e["name"] for e in extractor["engineConfigs"]}
    route = one(docs, "HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert {(b["kind"], b["name"]) for b in backends} == {("InferencePool", pool["metadata"]["name"])}


def _extractor(cfg: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in cfg["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]


def _models(docs) -> list[dict[str, Any]]:
    """The models of the --config file the pod reads (its ConfigMap)."""
    return yaml.safe_load(config_file(docs)[1])["models"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_config_map_holds_a_config_file_the_server_accepts(target, tmp_path, monkeypatch):
    docs = render(target)
    path, text = config_file(docs)
    local = tmp_path / Path(path).name
    local.write_text(text)
    models = load_config(str(local))  # the server's own loader: schema, names, batching knobs
    assert {m.kind for m in models} == {"embeddings", "chat"}
    # The container's command line and environment, as `ferry serve` parses and checks them at
    # start, with the config path pointing at the copy here and the Secret's values filled in.
    for name, e in env(docs).items():
        monkeypatch.setenv(name, e.get("value", "from-the-secret"))
    args = [str(local) if a == path else a for a in container(docs)["args"]]
    command, cfg = from_args(args)
    assert command == "serve" and cfg.config == str(local) and cfg.engine_cores
    cfg.validate()
    assert cfg.api_keys == ["from-the-secret"] and cfg.admin_token == "from-the-secret"


def test_the_gpu_overlay_asks_for_a_gpu_and_runs_float16_on_it():
    docs = render("overlays/gpu")
    resources = container(docs)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert resources["requests"]["nvidia.com/gpu"] == "1"
    for m in _models(docs):
        assert m["device"].startswith("cuda"), m
        assert m["dtype"] == "float16", m


def test_the_cpu_overlay_asks_for_no_gpu_and_runs_float32():
    docs = render("overlays/cpu")
    resources = container(docs)["resources"]
    assert not any("nvidia.com/gpu" in resources.get(k, {}) for k in ("limits", "requests"))
    for m in _models(docs):
        assert (m["device"], m["dtype"]) == ("cpu", "float32"), m


@pytest.mark.parametrize("target", TARGETS)
def test_the_endpoint_picker_reads_ferry_series_of_a_served_chat_model(target):
    docs = render(target)
    cfg = epp_config(docs)
    names = {p.get("name") or p["type"] for p in cfg["plugins"]}
    refs = [r["pluginRef"] for prof in cfg["schedulingProfiles"] for r in prof["plugins"]]
    refs += [s["pluginRef"] for s in cfg["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in cfg["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= names, "a pluginRef names no plugin"
    (ferry,) = (e for e in _extractor(cfg)["engineConfigs"] if e["name"] == "ferry")
    specs = {k: parse_spec(ferry[k]) for k in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")}
    assert {k: name for k, (name, _) in specs.items()} == {
        "queuedRequestsSpec": "ferry_queue_depth",
        "runningRequestsSpec": "ferry_running_sequences",
        "kvUsageSpec": "ferry_kv_cache_usage_ratio",
    }
    chat = {m["name"] for m in _models(docs) if m["kind"] == "chat"}
    for name, labels in specs.values():
        assert labels.get("model") in chat, f"{name} selects model {labels.get('model')!r}, not a chat model served"
    source = next(p for p in cfg["plugins"] if p["type"] == "metrics-data-source")["parameters"]
    assert set(source["families"]) >= FERRY_SERIES, "the data source drops a family the extractor reads"


def test_keda_scales_on_the_summed_queue_of_this_deployment_per_replica():
    docs = render("base+components/keda")
    so = one(docs, "ScaledObject")
    deployment = one(docs, "Deployment", "ferry")
    assert so["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] >= 1, "scaling to zero would cost a model load per first request"
    served = {m["name"] for m in _models(docs)}
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for trigger in so["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        # AverageValue: KEDA divides the query's value by the replica count, so the query is the sum.
        assert trigger["metricType"] == "AverageValue"
        query = trigger["metadata"]["query"]
        assert query.startswith("sum(ferry_queue_depth{") and query.endswith("})")
        _, labels = parse_spec(query[len("sum(") : -1])
        assert labels["namespace"] == deployment["metadata"]["namespace"]
        assert labels["app_kubernetes_io_name"] == pod_labels["app.kubernetes.io/name"]
        assert labels["model"] in served
    podmonitor = one(docs, "PodMonitor")
    assert "app.kubernetes.io/name" in podmonitor["spec"]["podTargetLabels"]  # the label the queries select on


def test_the_hpa_reads_the_metric_the_prometheus_adapter_rule_serves():
    docs = render("base+components/hpa")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment", "ferry")["metadata"]["name"]
    values = yaml.safe_load((K8S / "components" / "hpa" / "prometheus-adapter-values.yaml").read_text())
    rules = values["rules"]["custom"]
    served_metrics = {r["name"]["as"] for r in rules}
    served_models = {m["name"] for m in _models(docs)}
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
        assert metric["pods"]["metric"]["name"] in served_metrics
        assert metric["pods"]["metric"]["selector"]["matchLabels"]["model"] in served_models
    for rule in rules:
        assert rule["seriesQuery"].startswith("ferry_queue_depth{")
        assert rule["name"]["matches"] == "^ferry_queue_depth$"
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
