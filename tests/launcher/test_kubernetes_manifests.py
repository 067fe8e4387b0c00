"""examples/kubernetes validates: core objects against Kubernetes' own JSON schemas (the
``kubernetes-validate`` package, strict: unknown fields are errors), the PyTorchJob and JobSet
against schemas vendored in tests/launcher/data/kubernetes (their pod and Job templates against
Kubernetes' schemas again); and the probes point at chameleon-run's /healthz and /readyz on its
--metrics-port. Nothing here talks to a cluster (docs/launcher.md says what is untested)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "kubernetes"
VENDORED = Path(__file__).parent / "data" / "kubernetes"
K8S = "1.33"
CRDS = {("kubeflow.org/v1", "PyTorchJob"): "pytorchjob-kubeflow-v1.json",
        ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-jobset-v1alpha2.json"}


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        found += [(f"{path.name}:{d['kind']}", d) for d in yaml.safe_load_all(path.read_text())
                  if d]
    return found


def validate_crd(doc: dict) -> None:
    schema = json.loads((VENDORED / CRDS[doc["apiVersion"], doc["kind"]]).read_text())
    version = [v for v in kubernetes_validate.utils.all_versions() if v.startswith(K8S)][-1]
    definitions = schema_contents(f"kubernetes-json-schema/v{version}-local-strict/"
                                  "_definitions.json", version)
    registry = Resource.from_contents(definitions) @ Registry()
    jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)


def validate(doc: dict) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRDS:
        validate_crd(doc)
    else:
        kubernetes_validate.validate(doc, K8S, strict=True)


def test_the_examples_are_the_expected_objects():
    assert sorted(name for name, _ in documents()) == [
        "etcd.yaml:Service", "etcd.yaml:StatefulSet", "jobset.yaml:JobSet",
        "pytorchjob.yaml:PyTorchJob"]


@pytest.mark.parametrize(("name", "doc"), documents(), ids=[n for n, _ in documents()])
def test_each_manifest_validates_against_its_schema(name, doc):
    validate(doc)


def test_a_wrong_field_is_caught_in_the_crd_and_in_its_pod_template():
    docs = dict(documents())
    job = json.loads(json.dumps(docs["pytorchjob.yaml:PyTorchJob"]))
    job["spec"]["elasticPolicy"]["minReplica"] = 2            # a typo
    with pytest.raises(jsonschema.ValidationError, match="minReplica"):
        validate(job)
    jobset = json.loads(json.dumps(docs["jobset.yaml:JobSet"]))
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["readinessProbe"]["httpGet"]["path"] = 7   # not a string
    with pytest.raises(jsonschema.ValidationError):
        validate(jobset)


def containers(doc: dict) -> list[dict]:
    if doc["kind"] == "PyTorchJob":
        return [c for spec in doc["spec"]["pytorchReplicaSpecs"].values()
                for c in spec["template"]["spec"]["containers"]]
    if doc["kind"] == "JobSet":
        return [c for job in doc["spec"]["replicatedJobs"]
                for c in job["template"]["spec"]["template"]["spec"]["containers"]]
    return []


@pytest.mark.parametrize("kind", ["PyTorchJob", "JobSet"])
def test_training_pods_probe_chameleon_runs_endpoints_and_use_etcd_v3(kind):
    doc = next(d for _, d in documents() if d["kind"] == kind)
    for container in containers(doc):
        args = container["args"]
        assert container["command"] == ["chameleon-run"]
        assert "--rdzv-backend=etcd-v3" in args and "--metrics-port=9400" in args
        assert "--metrics-address=0.0.0.0" in args   # a probe comes from outside the pod
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports[container["readinessProbe"]["httpGet"]["port"]] == 9400
        assert "--checkpoint-dir=/checkpoints/chameleon-gpt" in args   # preemption keeps it


def test_the_jobset_acts_on_chameleon_runs_exit_statuses():
    from chameleon_elastic.exit_status import ExitStatus

    doc = next(d for _, d in documents() if d["kind"] == "JobSet")
    rules = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    by_action = {}
    for rule in rules:
        for code in rule.get("onExitCodes", {}).get("values", ()):
            by_action[code] = rule["action"]
    assert by_action == {ExitStatus.PREEMPTED: "Ignore", ExitStatus.USAGE: "FailJob",
                         ExitStatus.DO_NOT_REQUEUE: "FailJob"}
