"""The agent's ``upgrades`` table: name -> argv, from the config file or ``GPUPOOL_UPGRADES``; names
and commands are checked when the agent starts (a bad entry is a configuration error naming it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodes.agent.config import ConfigError, load_config

BASE = {"GPUPOOL_PORTAL_URL": "https://portal.example"}


def test_upgrades_come_from_the_config_file_or_the_environment(tmp_path: Path) -> None:
    config_file = tmp_path / "agent.toml"
    config_file.write_text('[upgrades]\ndriver-560 = ["/usr/local/sbin/upgrade-driver", "560.35.03"]\n')
    config = load_config(env=BASE, config_file=config_file).validate()
    assert config.upgrades == {"driver-560": ["/usr/local/sbin/upgrade-driver", "560.35.03"]}
    env = {**BASE, "GPUPOOL_UPGRADES": json.dumps({"fw.1": ["/opt/fw/flash"]})}
    assert load_config(env=env).validate().upgrades == {"fw.1": ["/opt/fw/flash"]}
    assert load_config(env=BASE).validate().upgrades == {}


@pytest.mark.parametrize(
    "upgrades, names",
    [
        ({"driver 560": ["/bin/true"]}, "'driver 560'"),
        ({"-x": ["/bin/true"]}, "'-x'"),
        ({"ok": ["upgrade-driver"]}, "upgrades.ok"),  # not an absolute path: no PATH search
        ({"ok": []}, "upgrades.ok"),
        ({"ok": "/bin/true --all"}, "upgrades.ok"),  # a string is not an argv
        ({"ok": ["/bin/true", 3]}, "upgrades.ok"),
    ],
)
def test_a_bad_upgrade_entry_is_a_configuration_error(upgrades, names) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(env={**BASE, "GPUPOOL_UPGRADES": json.dumps(upgrades)}).validate()
    assert names in str(refused.value)
