"""deploy/Dockerfile installs a pinned CUDA torch and triton from deploy/gpu-constraints.txt
before kvray (and kvray under the same constraints), checks the CUDA build at build time, and
documents that CUDA version; the pins satisfy kvray's own requirements. Docker is not needed:
the Dockerfile is read as text."""

from __future__ import annotations

import re
import shlex

import tomllib
from packaging.requirements import Requirement

from tests.deploy.manifests import DEPLOY, ROOT

CONSTRAINTS_IN_IMAGE = "/home/ray/gpu-constraints.txt"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for each Dockerfile instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def build_args() -> dict[str, str]:
    pairs = [rest.partition("=") for keyword, rest in instructions() if keyword == "ARG"]
    return {name: default for name, _, default in pairs}


def constraints() -> dict[str, Requirement]:
    lines = (DEPLOY / "gpu-constraints.txt").read_text().splitlines()
    requirements = [Requirement(line) for line in lines if line.strip() and line[0] != "#"]
    return {r.name: r for r in requirements}


def pinned(name: str) -> str:
    (specifier,) = constraints()[name].specifier
    return specifier.version


def run_index(predicate) -> int:
    (index,) = [i for i, (k, rest) in enumerate(instructions()) if k == "RUN" and predicate(rest)]
    return index


def constraint_files(run: str) -> list[str]:
    words = shlex.split(run)
    return [words[i + 1] for i, word in enumerate(words) if word == "-c"]


def test_the_constraints_pin_torch_and_triton_exactly():
    pins = constraints()
    assert set(pins) == {"torch", "triton"}
    for requirement in pins.values():
        assert [s.operator for s in requirement.specifier] == ["=="], requirement


def test_torch_and_triton_are_installed_with_the_constraints_before_kvray():
    steps = instructions()
    assert build_args()["GPU_CONSTRAINTS"] == "deploy/gpu-constraints.txt"
    copy_constraints = steps.index(
        ("COPY", f"--chown=ray:users ${{GPU_CONSTRAINTS}} {CONSTRAINTS_IN_IMAGE}")
    )
    torch = run_index(lambda run: {"torch", "triton"} <= set(shlex.split(run)))
    check = run_index(lambda run: "torch.version.cuda" in run)
    copy_source = steps.index(("COPY", "--chown=ray:users . /home/ray/kvray"))
    kvray = run_index(lambda run: "/home/ray/kvray" in shlex.split(run))
    assert copy_constraints < torch < check < copy_source < kvray
    for run in (torch, kvray):
        assert constraint_files(steps[run][1]) == [CONSTRAINTS_IN_IMAGE], steps[run]


def test_the_cuda_check_names_the_cuda_the_readme_documents():
    (_, check) = instructions()[run_index(lambda run: "torch.version.cuda" in run)]
    assert "assert torch.version.cuda == '${TORCH_CUDA}'" in check
    cuda = build_args()["TORCH_CUDA"]
    assert re.fullmatch(r"\d+\.\d+", cuda), cuda
    readme = (DEPLOY / "README.md").read_text()
    assert f"`torch=={pinned('torch')}` from PyPI, is the CUDA {cuda} build" in readme
    assert "R580 branch or newer" in readme
    assert f"CUDA {cuda}" in (DEPLOY / "Dockerfile").read_text()


def test_the_pins_satisfy_kvrays_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = [Requirement(d) for d in project["project"]["dependencies"]]
    by_name = {r.name: r for r in requirements}
    for name in ("torch", "triton"):
        assert by_name[name].specifier.contains(pinned(name)), (by_name[name], pinned(name))
