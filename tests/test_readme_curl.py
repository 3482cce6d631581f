"""The README's curl examples work as written: they are read from README.md, pointed at a live
server's port (the README says localhost:8000) and run by bash with the real curl, against a
server started as the README starts it: ``make serve`` (``aserve serve``'s defaults, parsed by
its own argument parser) with the ``ARGS`` the README gives for the admin routes."""
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from aserve.commands import build_parser
from aserve.commands.serve import server_settings
from aserve.config import ClusterConfig
from tests.api_support import ENGINE, ServerThread

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


def readme_serve_args(monkeypatch):
    """``aserve serve`` as the README's ``make serve ARGS='...'`` runs it, parsed by the CLI itself
    (no key from this environment leaks in)."""
    monkeypatch.delenv("ASERVE_API_KEY", raising=False)
    monkeypatch.delenv("ASERVE_ADMIN_KEY", raising=False)
    (args,) = re.findall(r"make serve ARGS='([^']*)'", README.read_text())
    return build_parser().parse_args(["serve", *shlex.split(args)])


def test_readme_has_the_examples():
    cmds = curl_commands()
    assert len(cmds) >= 5
    assert any("/v1/chat/completions" in c for c in cmds) and any('"stream": true' in c for c in cmds)
    assert "`--mode coupled --instances 2 --batching sarathi`" in README.read_text()  # what it says make serve runs


def test_readme_curl_examples_run_as_written(monkeypatch):
    a = readme_serve_args(monkeypatch)
    assert (a.mode, a.instances, a.batching) == ("coupled", 2, "sarathi"), "the README's default changed"
    settings = server_settings(a)
    assert settings.admin_key is not None
    cfg = ClusterConfig(mode=a.mode, num_prefill=a.prefill, num_decode=a.decode, num_coupled=a.instances)
    assert ENGINE.batching == a.batching, "the test engine batches as make serve does"
    with ServerThread(cfg, settings) as server:
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
        assert [i["role"] for i in instances] == ["coupled", "coupled"]
        # without the README's admin key, the same route is refused
        bare = subprocess.run(["curl", "-s", f"127.0.0.1:{server.port}/admin/instances"], capture_output=True,
                              text=True, timeout=60)
        assert json.loads(bare.stdout)["error"]["type"] == "authentication_error"


def test_make_serve_without_args_leaves_admin_off(monkeypatch):
    monkeypatch.delenv("ASERVE_ADMIN_KEY", raising=False)
    assert server_settings(build_parser().parse_args(["serve"])).admin_state == "off"
