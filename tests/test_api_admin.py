"""Admin routes of the running server: list, add, flip and remove instances over HTTP, with the
API key required, refusals as OpenAI-shaped 4xx, and streaming requests unharmed meanwhile."""
import json
import threading

import openai
import pytest

from aserve.api.server import ServerSettings
from aserve.config import ClusterConfig
from tests.api_support import ServerThread

pytestmark = pytest.mark.slow
KEY = "admin-key-42"


@pytest.fixture(scope="module")
def server():
    with ServerThread(ClusterConfig(mode="disagg", num_prefill=1, num_decode=1, chunk_size=64),
                      ServerSettings(api_key=KEY)) as s:
        yield s


def call(server, method, path, body=None, auth=True):
    status, _, raw = server.request(method, path, body, auth=auth)
    return status, json.loads(raw) if raw else None


def test_admin_needs_the_key(server):
    for method, path in (("GET", "/admin/instances"), ("POST", "/admin/instances"),
                         ("DELETE", "/admin/instances/d1"), ("POST", "/admin/instances/p0/flip")):
        status, body = call(server, method, path, {"role": "decode"}, auth=False)
        assert status == 401 and body["error"]["type"] == "authentication_error", (method, path)


def test_list_add_flip_remove_while_streaming(server):
    status, body = call(server, "GET", "/admin/instances")
    assert status == 200
    assert {(i["id"], i["role"], i["state"]) for i in body["data"]} == {("p0", "prefill", "active"),
                                                                      ("d1", "decode", "active")}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    texts = {}

    def stream(i):
        out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": f"Count to {i}"}],
                                             max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
        texts[i] = [c.choices[0].delta.content or "" for c in out if c.choices]

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for w in workers:
        w.start()
    status, added = call(server, "POST", "/admin/instances", {"role": "decode"})
    assert status == 201 and added["role"] == "decode" and added["state"] == "active"
    new_id = added["id"]
    status, flip = call(server, "POST", f"/admin/instances/{new_id}/flip", {"role": "prefill"})
    assert status == 200 and flip["to"] == "prefill" and flip["flip_s"] < 0.05
    status, gone = call(server, "DELETE", "/admin/instances/p0")
    assert status == 200 and gone == {"id": "p0", "removed": True, "drain_s": gone["drain_s"]}
    for w in workers:
        w.join(120)
    assert len(texts) == 6 and all(len(t) >= 24 for t in texts.values())  # role chunk + 24 tokens
    status, body = call(server, "GET", "/admin/instances")
    assert {(i["id"], i["role"]) for i in body["data"]} == {("d1", "decode"), (new_id, "prefill")}
    assert body["flips"] and body["flips"][-1]["instance"] == new_id
    snap = server.wait_idle()
    assert snap["num_flips"] == 1
    assert {e["kind"] for e in snap["events"]} >= {"instance_added", "flip", "instance_removed"}


def test_refusals_are_4xx_with_openai_errors(server):
    cases = [("DELETE", "/admin/instances/nope", None, 404),
             ("POST", "/admin/instances", {"role": "coupled"}, 400),
             ("POST", "/admin/instances", {"role": 3}, 400),
             ("POST", "/admin/instances", {"role": "decode", "gpu": 1}, 400),
             ("POST", "/admin/instances", b"{not json", 400),
             ("POST", "/admin/instances/d1/flip", {"role": "decode"}, 400)]
    for method, path, body, want in cases:
        status, err = call(server, method, path, body)
        assert status == want, (method, path, body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}
    # the last decode instance may neither go nor flip
    status, err = call(server, "DELETE", "/admin/instances/d1")
    assert status == 409 and "last active decode" in err["error"]["message"]
    status, err = call(server, "POST", "/admin/instances/d1/flip")
    assert status == 409
    status, body = call(server, "GET", "/health", auth=False)
    assert status == 200
