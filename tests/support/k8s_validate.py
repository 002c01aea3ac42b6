"""Offline validation of Kubernetes manifests (`switchyard k8s`'s output), as an API server
with strict field validation (kubectl's default since 1.27) would judge them, without one.

Built-in kinds go through kubernetes-validate, whose wheel carries the API's schemas; its
strict variant rejects unknown fields. It stops at a document's first error.

LeaderWorkerSet objects go through jsonschema against the CRD vendored under
deploy/k8s/schemas (its README says which release). A CRD's OpenAPI v3 schema is not a
JSON Schema as is: jsonschema allows unknown fields where the API server prunes them (and
strict validation turns a pruned field into an error), and it ignores the `x-kubernetes-*`
and `nullable` keywords. `_structural` rewrites those into plain JSON Schema. CEL rules
(`x-kubernetes-validations`) are not evaluated; LWS v1's CRD has none.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import VersionNotSupportedError

from tests.support import ROOT

LWS_CRD = ROOT / "deploy" / "k8s" / "schemas" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"

Schema = dict[str, Any]


def validate(text: str, kubernetes_version: str = "1.31.0") -> list[str]:
    """The errors of a multi-document YAML manifest (empty: valid), each as
    `document <i> (<kind>/<name>): <path>: <message>`; empty documents are skipped."""
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        return [f"YAML: {e}"]
    errors: list[str] = []
    for index, document in enumerate(documents):
        if document is not None:
            label = f"document {index} ({_name(document)})"
            errors += [f"{label}: {e}" for e in _document_errors(document, kubernetes_version)]
    return errors


def _name(document: object) -> str:
    """`kind/name` for the error messages, whatever the document's shape."""
    if not isinstance(document, dict):
        return "?"
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return f"{document.get('kind', '?')}/{name or '?'}"


def _document_errors(document: object, kubernetes_version: str) -> list[str]:
    """One document's errors: its type, what every object needs, then its kind's schema."""
    if not isinstance(document, dict):
        return [f"<root>: a manifest is a mapping, not {type(document).__name__}"]
    header = [f"{key}: required (a non-empty string)" for key in ("apiVersion", "kind")
              if not (isinstance(document.get(key), str) and document[key])]
    if header:
        return header
    errors = _name_errors(document)
    if document["kind"] == LWS_KIND:
        return errors + _lws_errors(document, kubernetes_version)
    return errors + _builtin_errors(document, kubernetes_version)


def _name_errors(document: Schema) -> list[str]:
    """The API server refuses an object without a name; neither schema requires one."""
    metadata = document.get("metadata")
    if isinstance(metadata, dict) and not (metadata.get("name") or metadata.get("generateName")):
        return ["metadata.name: required"]
    if metadata is None:
        return ["metadata: required"]
    return []


def _builtin_errors(document: Schema, kubernetes_version: str) -> list[str]:
    """A built-in kind's first error against the Kubernetes API's strict schema; a kind
    kubernetes-validate has no schema for (a typo in kind or apiVersion) is an error too."""
    try:
        kubernetes_validate.validate(document, kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_path(e.absolute_path)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"<root>: {e.message}"]
    except VersionNotSupportedError as e:
        # The caller's mistake, not the manifest's: fail loudly.
        raise ValueError(e.message) from None
    return []


def _lws_errors(document: Schema, kubernetes_version: str) -> list[str]:
    """A LeaderWorkerSet's errors: its apiVersion, every error against the CRD's schema, and
    its metadata as the ObjectMeta the API server decodes it into."""
    errors = []
    if document["apiVersion"] != LWS_API_VERSION:
        errors.append(f"apiVersion: {document['apiVersion']!r} is not {LWS_API_VERSION!r}")
    found = sorted(_lws_validator().iter_errors(document),
                   key=lambda e: (_path(e.absolute_path), e.message))
    errors += [f"{_path(e.absolute_path)}: {e.message}" for e in found]
    if isinstance(document.get("metadata"), dict):
        errors += _object_meta_errors(document["metadata"], kubernetes_version)
    return errors


def _object_meta_errors(metadata: Schema, kubernetes_version: str) -> list[str]:
    """The CRD's schema leaves the root `metadata` open (the API server checks it as
    ObjectMeta); kubernetes-validate's public API checks ObjectMeta as a ConfigMap's."""
    carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}
    return _builtin_errors(carrier, kubernetes_version)


@cache
def _lws_validator() -> jsonschema.Draft4Validator:
    """The validator of LWS v1's structural schema, built once (the CRD is 1.3 MB).
    Draft 4: OpenAPI v3.0's schema keywords are its (`exclusiveMaximum` a boolean)."""
    schema = _structural(lws_schema())
    schema["properties"]["metadata"] = {"type": "object"}  # see _object_meta_errors
    return jsonschema.Draft4Validator(schema)


def lws_schema(crd_path: Path = LWS_CRD) -> Schema:
    """`spec.versions[name=v1].schema.openAPIV3Schema` of the vendored LWS CRD."""
    try:
        with crd_path.open(encoding="utf-8") as f:
            crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"needs the LeaderWorkerSet CRD at {crd_path} (see deploy/k8s/schemas/README.md)"
        ) from None
    versions = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    if not versions:
        raise ValueError(f"{crd_path} defines no version v1 of {LWS_KIND}")
    return versions[0]["schema"]["openAPIV3Schema"]


def _structural(node: Schema) -> Schema:
    """A CRD schema node as JSON Schema that rejects what the API server would prune:
    an object's fields beyond `properties`, unless `x-kubernetes-preserve-unknown-fields`
    (an object with neither properties nor additionalProperties keeps no field at all).
    `x-kubernetes-int-or-string` and `nullable` become the types they stand for."""
    out = dict(node)
    if "properties" in node:
        out["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            out[key] = _structural(node[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [_structural(v) for v in node[key]]
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if node.get("type") == "object" and "additionalProperties" not in node and not preserve:
        out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") is True and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") is True and isinstance(node.get("type"), str):
        out["type"] = [node["type"], "null"]
    return out


def _path(parts: Iterable[str | int]) -> str:
    """A JSON path as kubectl writes it: `spec.template.spec.containers[0].image`."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "<root>"
