"""Rendering deploy/kubernetes with `kubectl kustomize`, and reading what it renders."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
SCHEMAS = K8S / "schemas"
# What a user applies: the base alone, each overlay, and the base with each optional component.
TARGETS = ("base", "overlays/cpu", "overlays/gpu", "base+components/keda", "base+components/hpa")
# Kinds that Kubernetes itself defines (kubernetes-validate has their schemas); the rest are custom
# resources, checked against the JSON Schemas in deploy/kubernetes/schemas/.
CUSTOM = {
    "InferencePool": "inferencepool",
    "HTTPRoute": "httproute",
    "PodMonitor": "podmonitor",
    "ScaledObject": "scaledobject",
}


@functools.cache
def render(target: str) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize` renders for a target ("base+components/x": base with x)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: cannot render deploy/kubernetes")
    base, *components = target.split("+")
    if not components:
        out = _kustomize(kubectl, K8S / base)
    else:
        # A throwaway kustomization that adds the components to the base, as an overlay would.
        with tempfile.TemporaryDirectory() as tmp:
            kustomization = {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize takes relative paths only
                "resources": [os.path.relpath(K8S / base, tmp)],
                "components": [os.path.relpath(K8S / c, tmp) for c in components],
            }
            (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
            out = _kustomize(kubectl, Path(tmp))
    return tuple(d for d in yaml.safe_load_all(out) if d)


def _kustomize(kubectl: str, path: Path) -> str:
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return done.stdout


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"].startswith(name))]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    pod = one(docs, "Deployment", "ferry")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "ferry")


def env(docs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(docs).get("env", [])}


def config_file(docs: tuple[dict[str, Any], ...]) -> tuple[str, str]:
    """(the path `--config` names, the text of that file as the pod sees it from its ConfigMap)."""
    c = container(docs)
    args = c["args"]
    path = args[args.index("--config") + 1]
    pod = one(docs, "Deployment", "ferry")["spec"]["template"]["spec"]
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = one(docs, "ConfigMap", volume["configMap"]["name"])
    assert cm["metadata"]["name"] == volume["configMap"]["name"], "the volume names a ConfigMap that is not rendered"
    key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    assert key in cm["data"], f"ConfigMap {cm['metadata']['name']} has no {key}"
    return path, cm["data"][key]


def epp_config(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    cm = one(docs, "ConfigMap", "ferry-epp-config")
    return yaml.safe_load(cm["data"]["epp-config.yaml"])


def schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


# A metric spec as the endpoint picker reads one: `name{label=value,...}` (PromQL instant-vector
# selector syntax; the picker also accepts unquoted values). Only equality matchers select.
_SPEC = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*$")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^",}\s]+))\s*')


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    m = _SPEC.match(spec)
    assert m, f"not a metric spec: {spec!r}"
    name, body = m.group(1), m.group(2) or ""
    labels: dict[str, str] = {}
    for part in filter(None, (p for p in body.split(","))):
        lm = _MATCHER.fullmatch(part)
        assert lm, f"not an equality matcher in {spec!r}: {part!r}"
        labels[lm.group(1)] = lm.group(2) if lm.group(2) is not None else lm.group(3)
    return name, labels
