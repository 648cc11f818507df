"""Every `sh` example in the README runs against a live cluster and succeeds."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
EXAMPLES = re.findall(r"```sh\n(.*?)```", README, flags=re.S)


def test_the_readme_leads_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
    assert first_block.splitlines()[0].startswith("make up") and "make test" in first_block.splitlines()[1]
    assert README.index("make up") < README.index("## ")


def test_the_readme_has_examples():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("example", EXAMPLES)
def test_readme_example_runs(cluster, example):
    script = example.replace("127.0.0.1:8000", f"127.0.0.1:{cluster.port}")
    result = subprocess.run(["bash", "-eo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    output = result.stdout.strip()
    if "stream" in script:
        assert output.endswith("data: [DONE]")
    else:
        decoder, position = json.JSONDecoder(), 0
        while position < len(output):  # one JSON document per curl, back to back
            body, position = decoder.raw_decode(output, position)
            assert "error" not in body
            position = len(output) - len(output[position:].lstrip())
