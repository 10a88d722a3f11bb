"""The deployment's doors: /metrics needs its token everywhere, no pod carries a Kubernetes API
token it does not use, and the namespace denies all traffic but what each part needs."""

from __future__ import annotations

import yaml

from tests.deploy.test_k8s import (  # kustomization, manifests: fixtures
    K8S,
    by_kind,
    kustomization,  # noqa: F401
    manifests,  # noqa: F401
    matches,
    pod_specs,
)

ROOT = K8S.parents[1]


def test_no_pod_mounts_a_service_account_token(manifests):  # noqa: F811
    specs = list(pod_specs(manifests))
    assert len(specs) >= 8
    for m, spec in specs:
        assert spec.get("automountServiceAccountToken") is False, m["metadata"]["name"]


def test_the_namespace_denies_by_default_and_allows_each_part_what_it_needs(manifests):  # noqa: F811
    policies = list(by_kind(manifests, "NetworkPolicy").values())
    deny = by_kind(manifests, "NetworkPolicy")["default-deny"]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}

    def allowed(labels: dict, kind: str) -> list[dict]:
        rules = []
        for p in policies:
            if kind in p["spec"]["policyTypes"] and p["spec"]["podSelector"] and selects(p, labels):
                rules += p["spec"].get(kind.lower(), [])
        return rules

    def selects(policy, labels) -> bool:
        selector = policy["spec"]["podSelector"]
        if "matchExpressions" in selector:
            return all(labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"])
        return matches(selector, labels)

    def ports(rules) -> set[int]:
        return {p["port"] for r in rules for p in r.get("ports", [])}

    for m, _spec in pod_specs(manifests):
        labels = m["spec"]["template"]["metadata"]["labels"]
        component = labels["app.kubernetes.io/component"]
        assert 53 in ports(allowed(labels, "Egress")), component
        inbound = ports(allowed(labels, "Ingress"))
        if component in ("web", "agent-web"):
            assert inbound == {8000}, component
            assert {5432, 6379} <= ports(allowed(labels, "Egress")), component
        else:
            assert inbound == set(), f"{component} takes no connections"
        if component == "agent":
            assert ports(allowed(labels, "Egress")) == {53, 443}


def test_metrics_need_the_token_in_every_deployment():
    secret = yaml.safe_load((K8S / "secret.yaml").read_text())
    assert secret["stringData"]["METRICS_TOKEN"]
    compose = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
    for name in ("web", "agent-web"):
        assert compose["services"][name]["environment"]["METRICS_TOKEN"].startswith("${METRICS_TOKEN:?"), name
