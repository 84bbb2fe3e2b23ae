"""Every command line the deployment files give a service parses with the real `pagedweight`
parser: the chart's container args (every value set), the Compose commands and the images'
default CMDs. An unknown or misspelt flag fails here, not in a crash-looping pod."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from deploy_helpers import ROOT, VALUE_SETS, helm_template, manifests

pytestmark = pytest.mark.deploy

ROLES = ("worker", "planner", "gateway")


def parser_for(role: str):
    from pagedweight.cli.main import build_parser

    return build_parser()


def assert_parses(args: list[str], where: str) -> None:
    parser = parser_for(args[0])
    try:
        parser.parse_args(args)
    except SystemExit:
        raise AssertionError(f"{where}: `pagedweight {' '.join(args)}` does not parse") from None


def chart_command_lines():
    for name, files in VALUE_SETS.items():
        for doc in manifests(helm_template(*files).stdout):
            if doc["kind"] in ("Deployment", "StatefulSet") and "redis" not in doc["metadata"]["name"]:
                (container,) = doc["spec"]["template"]["spec"]["containers"]
                yield f"{name}: {doc['metadata']['name']}", container["args"]


def test_chart_args_parse():
    lines = list(chart_command_lines())
    assert {args[0] for _, args in lines} == set(ROLES)
    for where, args in lines:
        assert_parses(args, where)


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"],
                                   ["docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.second-gpu.yml"]])
def test_compose_commands_parse(files):
    merged = {}
    for f in files:
        for name, service in yaml.safe_load((ROOT / f).read_text())["services"].items():
            merged.setdefault(name, {}).update(service)
    for name, service in merged.items():
        if "command" in service and service["command"][0] in ROLES:
            assert_parses(service["command"], f"{files[-1]}: {name}")
    assert {s["command"][0] for s in merged.values() if "command" in s} >= set(ROLES)


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "docker").glob("Dockerfile.*")), ids=lambda p: p.name)
def test_image_default_commands_parse(dockerfile):
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile.read_text(), re.M).group(1))
    assert cmd[0] in ROLES
    assert_parses(cmd, dockerfile.name)
