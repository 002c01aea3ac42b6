"""tests/support/k8s_validate.py can fail: a hand-written Deployment, Service and
LeaderWorkerSet pass, and each kind of mistake the renderer could make (an unknown field, a
wrong type, a missing required field, a misspelt LWS field, a wrong apiVersion) is an error
that names its path. Offline: the schemas are kubernetes-validate's and the vendored CRD's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tests.support.k8s_validate import _structural, lws_schema, validate

pytestmark = pytest.mark.timeout(60)

VALID = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: gateway
  labels: {app.kubernetes.io/name: switchyard, app.kubernetes.io/component: gateway}
spec:
  replicas: 2
  selector:
    matchLabels: {app.kubernetes.io/component: gateway}
  template:
    metadata:
      labels: {app.kubernetes.io/component: gateway}
    spec:
      containers:
      - name: gateway
        image: switchyard:latest
        command: [switchyard, gateway]
        ports: [{name: http, containerPort: 8000}]
        env:
        - name: HF_TOKEN
          valueFrom: {secretKeyRef: {name: hf-token, key: token, optional: true}}
        readinessProbe:
          httpGet: {path: /health, port: http}
---
apiVersion: v1
kind: Service
metadata:
  name: gateway
spec:
  selector: {app.kubernetes.io/component: gateway}
  ports: [{name: http, port: 80, targetPort: http}]
---
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: attention
  labels: {app.kubernetes.io/component: attention}
spec:
  replicas: 1
  startupPolicy: LeaderCreated
  leaderWorkerTemplate:
    size: 2
    restartPolicy: RecreateGroupOnPodRestart
    leaderTemplate:
      metadata:
        labels: {role: leader}
      spec:
        containers:
        - name: attention
          image: switchyard:latest
          command: [switchyard, attention, --rank, "0"]
          ports: [{name: rpc, containerPort: 7000}]
          readinessProbe:
            tcpSocket: {port: rpc}
          resources:
            limits: {cpu: "4", memory: 8Gi}
    workerTemplate:
      spec:
        containers:
        - name: attention
          image: switchyard:latest
          command: [switchyard, attention, --rank, $(LWS_WORKER_INDEX)]
          env:
          - name: HF_TOKEN
            valueFrom: {secretKeyRef: {name: hf-token, key: token}}
          readinessProbe:
            tcpSocket: {port: 7000}
"""

Docs = list[dict[str, Any]]


def edited(change: Callable[[Docs], object]) -> str:
    """VALID with `change` applied to its parsed documents (0 Deployment, 1 Service, 2 LWS)."""
    docs = list(yaml.safe_load_all(VALID))
    change(docs)
    return yaml.safe_dump_all(docs, sort_keys=False)


def lws_template(docs: Docs) -> dict[str, Any]:
    return docs[2]["spec"]["leaderWorkerTemplate"]


def assert_error(text: str, *parts: str) -> None:
    """Some error names every part (the document, the path, the offending field)."""
    errors = validate(text)
    assert any(all(p in e for p in parts) for e in errors), errors


def test_the_valid_manifest_passes() -> None:
    assert validate(VALID) == []
    assert validate(VALID, kubernetes_version="1.34.0") == []


def test_an_unknown_field_in_a_builtin_kind() -> None:
    def misspell(docs: Docs) -> None:
        container = docs[0]["spec"]["template"]["spec"]["containers"][0]
        container["comand"] = container.pop("command")

    assert_error(edited(misspell), "document 0 (Deployment/gateway)",
                 "spec.template.spec.containers[0]:", "'comand' was unexpected")


def test_a_wrong_type() -> None:
    text = edited(lambda docs: docs[0]["spec"].update(replicas="two"))
    assert_error(text, "document 0", "spec.replicas:", "'two' is not of type")


def test_a_missing_required_field() -> None:
    text = edited(lambda docs: docs[1]["spec"]["ports"][0].pop("port"))
    assert_error(text, "document 1 (Service/gateway)", "spec.ports[0]:",
                 "'port' is a required property")


def test_a_misspelt_lws_field() -> None:
    def misspell(docs: Docs) -> None:
        template = lws_template(docs)
        template["restartPolicey"] = template.pop("restartPolicy")

    assert_error(edited(misspell), "document 2 (LeaderWorkerSet/attention)",
                 "spec.leaderWorkerTemplate:", "'restartPolicey' was unexpected")


def test_an_unknown_field_deep_in_an_lws_pod_template() -> None:
    def misspell(docs: Docs) -> None:
        container = lws_template(docs)["leaderTemplate"]["spec"]["containers"][0]
        container["readinesProbe"] = container.pop("readinessProbe")

    assert_error(edited(misspell), "spec.leaderWorkerTemplate.leaderTemplate.spec.containers[0]:",
                 "'readinesProbe' was unexpected")


def test_lws_required_fields_types_and_enums() -> None:
    assert_error(edited(lambda docs: lws_template(docs).pop("workerTemplate")),
                 "spec.leaderWorkerTemplate:", "'workerTemplate' is a required property")
    assert_error(edited(lambda docs: lws_template(docs).update(size="two")),
                 "spec.leaderWorkerTemplate.size:", "'two' is not of type 'integer'")
    assert_error(edited(lambda docs: lws_template(docs).update(restartPolicy="Always")),
                 "spec.leaderWorkerTemplate.restartPolicy:", "'Always' is not one of")
    # int-or-string: a port is a number or a name, not a list.
    probe = ["workerTemplate", "spec", "containers", 0, "readinessProbe", "tcpSocket"]

    def bad_port(docs: Docs) -> None:
        node: Any = lws_template(docs)
        for key in probe:
            node = node[key]
        node["port"] = [7000]

    assert_error(edited(bad_port),
                 "spec.leaderWorkerTemplate.workerTemplate.spec.containers[0].readinessProbe"
                 ".tcpSocket.port:")


def test_lws_api_version_and_metadata() -> None:
    text = edited(lambda docs: docs[2].update(apiVersion="leaderworkerset.x-k8s.io/v2"))
    assert_error(text, "document 2", "apiVersion:", "leaderworkerset.x-k8s.io/v1")
    text = edited(lambda docs: docs[2]["metadata"].update(lables={"a": "b"}))
    assert_error(text, "document 2", "metadata:", "'lables' was unexpected")
    text = edited(lambda docs: docs[2].update(specs={}))
    assert_error(text, "document 2", "<root>:", "'specs' was unexpected")


def test_what_no_schema_covers_is_an_error() -> None:
    assert_error(edited(lambda docs: docs[1].update(kind="Servce")), "document 1", "Servce")
    assert_error(edited(lambda docs: docs[0]["metadata"].pop("name")), "metadata.name: required")
    assert_error(edited(lambda docs: docs[1].pop("apiVersion")), "apiVersion: required")
    assert validate("a: [b") and validate("- just\n- a list\n")


def test_an_unsupported_kubernetes_version_is_the_callers_mistake() -> None:
    with pytest.raises(ValueError, match="does not support"):
        validate(VALID, kubernetes_version="9.99.0")


def test_structural_schema_rules() -> None:
    """What the API server prunes is an error; what it preserves, or allows null, is not."""
    schema = _structural({
        "type": "object",
        "properties": {
            "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "closed": {"type": "object"},
            "port": {"x-kubernetes-int-or-string": True},
            "maybe": {"type": "string", "nullable": True},
        },
    })
    assert schema["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["open"]
    assert schema["properties"]["closed"]["additionalProperties"] is False
    assert schema["properties"]["port"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    assert schema["properties"]["maybe"]["type"] == ["string", "null"]


def test_the_vendored_crd_is_lws_v1() -> None:
    properties = lws_schema()["properties"]["spec"]["properties"]
    assert {"leaderWorkerTemplate", "replicas", "startupPolicy"} <= set(properties)
