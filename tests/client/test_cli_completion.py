"""Shell completion as a shell gets it: bash sources ``gpupool completion bash`` and completes
command lines through the real ``gpupool`` program; zsh's and fish's scripts call the program the
same way (their shells are not on this machine), so their answers are checked at that seam."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.client.conftest import ROOT


@pytest.fixture
def program(tmp_path) -> dict[str, str]:
    """An environment whose PATH has a ``gpupool`` that runs this checkout's client."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "gpupool"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gpupool "$@"\n')
    wrapper.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT / "client" / "src"),
        "HOME": str(tmp_path),
        "GPUPOOL_CONFIG_DIR": str(tmp_path / "config"),
    }


def _bash_complete(env: dict[str, str], words: list[str]) -> list[str]:
    script = (
        'eval "$(gpupool completion bash)"\n'
        f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
        'COMPREPLY=(); _gpupool_completion gpupool; printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    out = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], env=env, capture_output=True,
                         text=True, timeout=60, cwd=env["HOME"])  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line]


def test_bash_completes_commands_options_and_choices(program):
    assert _bash_complete(program, ["gpupool", "webh"]) == ["webhooks"]
    assert {"ps", "run", "show", "logs", "ssh", "stop", "volumes", "tokens"} <= set(
        _bash_complete(program, ["gpupool", ""])
    )
    assert _bash_complete(program, ["gpupool", "run", "--pl"]) == ["--plan"]
    assert _bash_complete(program, ["gpupool", "run", "--plan", ""]) == ["on_demand", "spot", "reserved"]
    assert _bash_complete(program, ["gpupool", "webhooks", "roll"]) == ["roll-secret"]
    assert _bash_complete(program, ["gpupool", "completion", ""]) == ["bash", "zsh", "fish"]


def test_zsh_and_fish_scripts_call_the_program_and_it_answers_them(program):
    env = {**os.environ, **program}
    zsh = subprocess.run(
        ["gpupool", "completion", "zsh"], env=env, capture_output=True, text=True, check=True
    )
    assert "#compdef gpupool" in zsh.stdout and "_GPUPOOL_COMPLETE=zsh_complete" in zsh.stdout
    fish = subprocess.run(
        ["gpupool", "completion", "fish"], env=env, capture_output=True, text=True, check=True
    )
    assert "_GPUPOOL_COMPLETE=fish_complete" in fish.stdout and "--command gpupool" in fish.stdout

    def answer(shell: str, words: str, cword: str) -> list[str]:
        out = subprocess.run(["gpupool"], env={**env, "_GPUPOOL_COMPLETE": f"{shell}_complete",
                             "COMP_WORDS": words, "COMP_CWORD": cword}, capture_output=True, text=True,
                             timeout=60, check=True)  # fmt: skip
        return out.stdout.splitlines()

    # zsh: type, value, help, for each candidate.
    lines = answer("zsh", "gpupool webh", "1")
    assert lines[:2] == ["plain", "webhooks"] and "Webhook endpoints" in lines[2]
    assert answer("zsh", "gpupool run --plan ", "3")[1::3] == ["on_demand", "spot", "reserved"]
    # fish: "type,value\thelp" per candidate.
    assert answer("fish", "gpupool webh", "webh")[0].startswith("plain,webhooks\t")
    assert [x.split("\t")[0] for x in answer("fish", "gpupool completion ", "")] == [
        "plain,bash",
        "plain,zsh",
        "plain,fish",
    ]


def test_the_program_is_the_console_script():
    """``pip install gpupool`` puts ``gpupool`` on PATH as its console script: the name the
    completion scripts call and register for."""
    import tomllib

    scripts = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"gpupool": "gpupool.cli:main"}
