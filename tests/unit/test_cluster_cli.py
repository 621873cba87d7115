"""The `vitforge plan` command (cluster/cli.py): the report it prints, its JSON, and a bad input
refused with a usage error."""

from __future__ import annotations

import json

import pytest

from common.cli import vitforge
from vitforge.core import errors


@pytest.mark.slow
def test_plan_cli_prints_and_refuses_bad_input():
    text = vitforge("plan", "--nodes", "4", "--device", "H200", "--comm-overlap", "0.5", "--offload-optimizer").stdout
    assert "4 nodes x 8 H200" in text and "ZeRO-3:" in text and "Young interval" in text
    assert "50% hidden behind compute" in text and "effective MFU" in text and "restart" in text
    assert "host memory per rank" in text and "offload 0.00 GB" in text.split("ZeRO-0:")[-1]  # stage 0: no offload
    assert "offload 0.00 GB" not in text.split("host memory")[1].split("ZeRO-3:")[1]
    figures = json.loads(vitforge("plan", "--nodes", "4", "--json").stdout)
    assert figures["gpus"] == 32 and figures["inputs"]["nodes"] == 4
    bad = vitforge("plan", "--device", "TPU9000", check=False)
    assert bad.returncode == errors.USAGE and "known devices are" in bad.stderr and "Traceback" not in bad.stderr
