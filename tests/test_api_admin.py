"""Admin routes of the running server: list, add, flip and remove instances over HTTP, behind
their own key (the inference key is refused), off without one unless opened, capped at
--max-instances; refusals as OpenAI-shaped 4xx, and streaming requests unharmed meanwhile."""
import json
import threading

import openai
import pytest

from aserve.api.server import ServerSettings
from aserve.config import ClusterConfig
from tests.api_support import ServerThread

pytestmark = pytest.mark.slow
KEY = "inference-key-42"
ADMIN = "admin-key-7"
MAX_INSTANCES = 3
ROUTES = (("GET", "/admin/instances"), ("POST", "/admin/instances"), ("DELETE", "/admin/instances/d1"),
          ("POST", "/admin/instances/p0/flip"), ("GET", "/admin/nothing"))


@pytest.fixture(scope="module")
def server():
    with ServerThread(ClusterConfig(mode="disagg", num_prefill=1, num_decode=1, chunk_size=64),
                      ServerSettings(api_key=KEY, admin_key=ADMIN, max_instances=MAX_INSTANCES)) as s:
        yield s


def call(server, method, path, body=None, key=ADMIN):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    status, _, raw = server.request(method, path, body, headers=headers, auth=False)
    return status, json.loads(raw) if raw else None


def test_admin_takes_the_admin_key_and_nothing_else(server):
    for method, path in ROUTES:
        for key, want, kind in ((None, 401, "authentication_error"), ("wrong", 401, "authentication_error"),
                                (KEY, 403, "permission_error")):
            status, body = call(server, method, path, {"role": "decode"}, key=key)
            assert status == want and body["error"]["type"] == kind, (method, path, key, body)
            assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = call(server, "GET", "/admin/instances", key=KEY)
    assert "--admin-key" in body["error"]["message"]
    assert call(server, "GET", "/admin/instances")[0] == 200
    assert call(server, "GET", "/admin/nothing")[0] == 404  # past the key, an unknown route
    # and the admin key is no inference key
    assert server.request("GET", "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}, auth=False)[0] == 401
    assert server.request("GET", "/v1/models")[0] == 200


@pytest.mark.parametrize("settings,want", [(ServerSettings(), 403), (ServerSettings(api_key=KEY), 403),
                                           (ServerSettings(admin_open=True), 200)],
                         ids=["no-keys", "inference-key-only", "admin-open"])
def test_without_an_admin_key_admin_is_off_unless_opened(settings, want):
    with ServerThread(ClusterConfig(mode="coupled", num_coupled=1), settings) as s:
        for key in (None, KEY, "anything"):
            status, body = call(s, "GET", "/admin/instances", key=key)
            assert status == want, (key, body)
            if want == 403:
                assert body["error"]["code"] == "admin_disabled" and "--admin-key" in body["error"]["message"]
        status, body = call(s, "POST", "/admin/instances", {"role": "coupled"}, key=None)
        assert status == (201 if want == 200 else 403), body
        if want == 200:
            assert call(s, "DELETE", f"/admin/instances/{body['id']}", key=None)[0] == 200
        s.wait_idle()


def test_settings_refuse_keys_that_mix():
    with pytest.raises(ValueError, match="differ from api_key"):
        ServerSettings(api_key="k", admin_key="k")
    with pytest.raises(ValueError, match="one or the other"):
        ServerSettings(admin_key="a", admin_open=True)
    with pytest.raises(ValueError, match="max_instances"):
        ServerSettings(max_instances=0)


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
    status, body = call(server, "GET", "/health", key=None)
    assert status == 200


def test_max_instances_caps_adds_even_when_they_race(server):
    """Each add allocates a KV pool: past --max-instances it is a 409 naming the flag, and adds
    fired together cannot slip past the cap while their devices are being built."""
    live = [i for i in call(server, "GET", "/admin/instances")[1]["data"] if i["state"] != "failed"]
    room = MAX_INSTANCES - len(live)
    assert room >= 1
    results = []
    workers = [threading.Thread(target=lambda: results.append(call(server, "POST", "/admin/instances",
                                                                     {"role": "decode"})))
               for _ in range(room + 2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    added = [body for status, body in results if status == 201]
    refused = [body for status, body in results if status != 201]
    assert len(added) == room and len(refused) == 2, results
    for body in refused:
        assert body["error"]["code"] == "instance_refused" and "--max-instances" in body["error"]["message"]
    assert call(server, "POST", "/admin/instances", {"role": "prefill"})[0] == 409
    for body in added:
        assert call(server, "DELETE", f"/admin/instances/{body['id']}")[0] == 200
    server.wait_idle()


def test_serve_flags_build_the_admin_settings_and_start_up_notes(monkeypatch):
    """``aserve serve``'s flags as parsed: the admin key from the flag or $ASERVE_ADMIN_KEY,
    --admin-open refused off loopback or beside a key, the key never the API key; and what the
    server says at start (admin off and how to turn it on; no API key on a public address)."""
    from aserve.commands import build_parser
    from aserve.commands.serve import is_loopback, server_settings, startup_notes

    parse = lambda *flags: build_parser().parse_args(["serve", *flags])  # noqa: E731
    monkeypatch.delenv("ASERVE_API_KEY", raising=False)
    monkeypatch.delenv("ASERVE_ADMIN_KEY", raising=False)
    default = server_settings(parse())
    assert default.admin_state == "off" and default.max_instances == 8
    (note,) = startup_notes(default, "127.0.0.1")
    assert "admin routes (/admin/*) are off" in note and "--admin-key" in note
    monkeypatch.setenv("ASERVE_ADMIN_KEY", "from-env")
    assert server_settings(parse()).admin_key == "from-env"
    assert server_settings(parse("--admin-key", "flag", "--max-instances", "3")).admin_key == "flag"
    monkeypatch.delenv("ASERVE_ADMIN_KEY")
    assert server_settings(parse("--admin-open")).admin_state == "open"
    for flags, message in ((("--admin-open", "--host", "0.0.0.0"), "not loopback"),
                           (("--admin-open", "--admin-key", "k"), "exclude each other"),
                           (("--admin-key", "k", "--api-key", "k"), "must differ")):
        with pytest.raises(ValueError, match=message):
            server_settings(parse(*flags))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("myhost")
    public = startup_notes(server_settings(parse("--host", "0.0.0.0", "--admin-key", "a")), "0.0.0.0")
    assert "need the admin key" in public[0] and public[1].startswith("WARNING: listening on 0.0.0.0 with no API key")
    assert len(startup_notes(server_settings(parse("--host", "0.0.0.0", "--api-key", "k")), "0.0.0.0")) == 1
