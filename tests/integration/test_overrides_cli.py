"""Overrides as users type them, through the tools: KEY=VALUE, YAML booleans,
lowercase keys, relative data paths."""

import json

from tests.helpers import DIGITS_CFG, run_tool


def test_key_equals_value_and_yaml_booleans_are_accepted():
    result = run_tool(
        "info_net.py", "--cfg", DIGITS_CFG, "--json",
        "OPTIM.MTA", "true", "TRAIN.IM_SIZE=32", "MODEL.NUM_CLASSES=7",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["im_size"] == 32


def test_lowercase_key_is_named_with_its_spelling():
    result = run_tool("info_net.py", "--cfg", DIGITS_CFG, "optim.base_lr", "0.1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: unknown config key optim.base_lr (did you mean 'OPTIM.BASE_LR'?)"
    ]


def test_relative_data_path_says_relative_to_what(tmp_path):
    result = run_tool(
        "train_net.py", "--cfg", DIGITS_CFG, "DATA.PATH", "no/such/digits",
        "OUT_DIR", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: DATA.PATH folder not found: no/such/digits ")
    assert "(relative to " in line


def test_config_file_mistakes_name_the_line_and_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("VIT:\n  PATCH_SIZE: 8\n NUM_LAYERS: 3\n")
    result = run_tool("info_net.py", "--cfg", str(bad))
    assert result.returncode == 2
    assert f"config file {bad} is not valid YAML at line 3, column 2:" in result.stderr
    (tmp_path / "base.yaml").write_text("OPTIM:\n  BASE_RL: 0.1\n")
    child = tmp_path / "child.yaml"
    child.write_text("_BASE_: base.yaml\nDESC: child\n")
    result = run_tool("info_net.py", "--cfg", str(child))
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        f"unknown config key OPTIM.BASE_RL (did you mean 'OPTIM.BASE_LR'?) "
        f"(in {tmp_path / 'base.yaml'})"
    ), result.stderr
