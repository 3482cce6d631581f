"""Record the request bodies a real client sends, for tests/data/clients/<client>.json.

    python tests/clients/recorder.py --client guidellm --version 0.8.1 \
        --out tests/data/clients/guidellm.json -- guidellm benchmark run --target {url} ...

It serves a small OpenAI-shaped HTTP endpoint on loopback (standard library only, so it runs
under any venv's Python), runs the client's command with ``{url}`` replaced by its address, and
writes every generation body the client sent, one of each shape (path, keys, stream), with the
client's name, version and command. It is a recording device, not a model: its answers are fixed
short texts in the OpenAI shape, enough for a client to carry on.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_CHUNKS = 8  # tokens a streamed answer carries (a client asking for 128 still gets a valid stream)


def _answer(path: str, body: dict, model: str) -> tuple[dict, list]:
    """(the non-streamed answer, the streamed chunks) for one generation request."""
    n = body.get("max_completion_tokens") or body.get("max_tokens") or MAX_CHUNKS
    num = max(1, min(int(n), MAX_CHUNKS))
    chat = path.endswith("/chat/completions")
    head = {"id": "rec-1", "created": int(time.time()), "model": body.get("model", model)}
    usage = {"prompt_tokens": 4, "completion_tokens": num, "total_tokens": 4 + num}
    text = " tok" * num
    if chat:
        full = {**head, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": "length"}]}
        chunks = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        chunks += [{"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": None}] * num
        chunks += [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
        obj = "chat.completion.chunk"
    else:
        full = {**head, "object": "text_completion", "usage": usage, "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}]}
        chunks = [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}] * num
        chunks += [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
        obj = "text_completion"
    events = [{**head, "object": obj, "choices": [c]} for c in chunks]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**head, "object": obj, "choices": [], "usage": usage})
    return full, events


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, model: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.model, self.bodies, self.gets, self.lock = model, [], [], threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: Recorder
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _json(self, obj: dict, status: int = 200) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        with self.server.lock:
            self.server.gets.append(self.path)
        if self.path.rstrip("/").endswith("/models"):
            self._json({"object": "list", "data": [{"id": self.server.model, "object": "model", "owned_by": "rec",
                                                    "created": 0, "max_model_len": 8192}]})
        elif self.path.startswith("/health") or self.path.startswith("/v1/health"):
            self._json({"status": "ok"})
        else:
            self._json({"error": {"message": "not found", "type": "not_found_error", "param": None, "code": None}}, 404)

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            return self._json({"error": {"message": "bad json", "type": "invalid_request_error"}}, 400)
        path = self.path.split("?")[0]
        with self.server.lock:
            self.server.bodies.append({"path": path, "body": body})
        if not path.endswith(("/completions", "/chat/completions")):
            return self._json({"error": {"message": "not found", "type": "not_found_error"}}, 404)
        full, events = _answer(path, body, self.server.model)
        if not body.get("stream"):
            return self._json(full)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for e in events:
            self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


def shapes(bodies: list[dict]) -> list[dict]:
    """One body of each shape: (path, its keys, stream); the first of each, in order."""
    seen, out = set(), []
    for b in bodies:
        key = (b["path"], tuple(sorted(b["body"])), bool(b["body"].get("stream")))
        if key not in seen:
            seen.add(key)
            out.append(b)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--client", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--note", default="")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the client's command; {url} is replaced")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    rec = Recorder(a.model)
    threading.Thread(target=rec.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{rec.server_address[1]}"
    cmd = [c.replace("{url}", url) for c in command]
    try:
        proc = subprocess.run(cmd, timeout=a.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    rec.shutdown()
    recorded = shapes(rec.bodies)
    out = {"client": a.client, "version": a.version, "note": a.note,
           "command": " ".join(c.replace(url, "{url}") for c in cmd), "exit": rc,
           "num_requests_seen": len(rec.bodies), "requests": recorded}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"{a.client} {a.version}: exit {rc}, {len(rec.bodies)} requests, {len(recorded)} shapes -> {a.out}",
          file=sys.stderr)
    return 0 if recorded else 1


if __name__ == "__main__":
    sys.exit(main())
