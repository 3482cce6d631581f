"""The README's curl examples work as written: they are read from README.md, pointed at a live
server's port (the README says localhost:8000) and run by bash with the real curl."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from aserve.config import ClusterConfig
from tests.api_support import ServerThread

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")]
README = Path(__file__).resolve().parents[1] / "README.md"


def curl_commands() -> list[str]:
    """Every command of the README's ```sh blocks that starts with curl (continuation lines
    joined: a quoted JSON body spans several lines)."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S):
        current = None
        for line in block.splitlines():
            if line.startswith("curl "):
                current = line
                commands.append(current)
            elif commands and current is not None:
                commands[-1] += "\n" + line
    return commands


def test_readme_has_the_examples():
    cmds = curl_commands()
    assert len(cmds) >= 5
    assert any("/v1/chat/completions" in c for c in cmds) and any('"stream": true' in c for c in cmds)


def test_readme_curl_examples_run_as_written():
    with ServerThread(ClusterConfig(mode="disagg")) as server:
        outputs = {}
        for cmd in curl_commands():
            live = cmd.replace("localhost:8000", f"127.0.0.1:{server.port}")
            done = subprocess.run(["bash", "-c", "set -o pipefail; " + live], capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, (cmd, done.stderr)
            outputs[cmd.split()[2].split("/", 1)[1] if "/" in cmd.split()[2] else cmd] = done.stdout
        assert json.loads(outputs["health"]) == {"status": "ok"}
        chat = json.loads(outputs["v1/chat/completions"])
        assert "Paris" in chat["choices"][0]["message"]["content"]
        events = [ln[6:] for ln in outputs["v1/completions"].splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 8
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        assert "Paris" in text
        count = float(outputs["metrics"].split()[-1])
        assert count >= 2  # the chat and the completion above
        instances = json.loads(outputs["admin/instances"])["data"]
        assert {i["role"] for i in instances} == {"prefill", "decode"}
