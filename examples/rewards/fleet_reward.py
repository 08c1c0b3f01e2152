#!/usr/bin/env python3
"""Serves an unchanged TRL-style reward function to gspo-train (Python 3.8+, standard library).

TRL calls a reward function as ``f(prompts=..., completions=..., completion_ids=..., **columns)``
with one list entry per completion (``columns``: the dataset's other fields) and takes back one
float per completion, or ``None`` where it does not apply. This script imports such a function
and answers gspo-train's requests for it (the protocol: crates/fleet-gspo/src/external.rs):

    # as a command that gspo-train starts (JSON lines on standard input and output)
    python3 examples/rewards/fleet_reward.py examples/rewards/trl_style_rewards.py:reward_len

    # as an HTTP endpoint (POST a batch, get its rewards; GET answers the greeting)
    python3 examples/rewards/fleet_reward.py examples/rewards/trl_style_rewards.py:reward_len \\
        --http 8000

and in gspo-train's TOML:

    [[reward_funcs]]
    name = "command"
    command = ["python3", "examples/rewards/fleet_reward.py",
               "examples/rewards/trl_style_rewards.py:reward_len"]

    [[reward_funcs]]
    name = "http"
    url = "http://127.0.0.1:8000"
    label = "reward_len"

FUNCTION is ``path/to/file.py:name`` or ``package.module:name``. What the function prints goes
to standard error (standard output carries the protocol). An exception fails the whole batch
(its message and traceback reach gspo-train and standard error); a reward that is not a finite
number (NaN, a string) fails its completion alone: gspo-train counts it and never scores it 0.
"""
import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROTOCOL_VERSION = 1


def load(spec):
    """The function named by FILE.py:NAME or MODULE:NAME."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        sys.exit(f"fleet_reward: {spec!r}: give FILE.py:FUNCTION or MODULE:FUNCTION")
    if target.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location("fleet_user_rewards", target)
        if module_spec is None:
            sys.exit(f"fleet_reward: cannot import {target!r}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if not callable(fn):
        sys.exit(f"fleet_reward: {target!r} has no function {name!r}")
    return fn


def encode(reward):
    """A reward as JSON: a finite number, null (None), or its text (gspo-train fails it)."""
    if reward is None:
        return None
    try:
        x = float(reward)
    except (TypeError, ValueError):
        return repr(reward)
    return x if math.isfinite(x) else repr(x)


def answer(fn, body):
    """The reply to one request: {"rewards": [...]} or {"error": "..."}."""
    try:
        kwargs = dict(body)
        prompts = kwargs.pop("prompts")
        completions = kwargs.pop("completions")
        stdout, sys.stdout = sys.stdout, sys.stderr  # the function's prints: standard error
        try:
            rewards = fn(prompts=prompts, completions=completions, **kwargs)
        finally:
            sys.stdout = stdout
        return {"rewards": [encode(r) for r in rewards]}
    except Exception as e:  # noqa: BLE001 - any failure of the user's function is reported
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}


def greeting(fn):
    return {"fleet_reward": PROTOCOL_VERSION, "name": fn.__name__}


def serve_lines(fn):
    # The protocol keeps a copy of standard output for itself; file descriptor 1 then points
    # at standard error, so that anything else written there (the function's prints, a C
    # library's) cannot break the protocol.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    out.write(json.dumps(greeting(fn)) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = answer(fn, json.loads(line))
        except json.JSONDecodeError as e:
            reply = {"error": f"the request is not JSON: {e}"}
        out.write(json.dumps(reply, allow_nan=False) + "\n")
        out.flush()


def serve_http(fn, host, port):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code, obj):
            data = json.dumps(obj, allow_nan=False).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            self._send(200, greeting(fn))

        def do_POST(self):  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(length))
            except json.JSONDecodeError as e:
                self._send(400, {"error": f"the request is not JSON: {e}"})
                return
            self._send(200, answer(fn, body))

        def log_message(self, fmt, *args):
            sys.stderr.write("fleet_reward: " + fmt % args + "\n")

    server = ThreadingHTTPServer((host, port), Handler)
    print(f"fleet_reward: {fn.__name__} on http://{host}:{server.server_port}",
          file=sys.stderr, flush=True)
    server.serve_forever()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("function", help="FILE.py:NAME or MODULE:NAME")
    p.add_argument("--http", type=int, metavar="PORT",
                   help="serve HTTP on this port (0: any free one) instead of standard input")
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args()
    fn = load(args.function)
    if args.http is None:
        serve_lines(fn)
    else:
        serve_http(fn, args.host, args.http)


if __name__ == "__main__":
    main()
