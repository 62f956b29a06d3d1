"""KVBRIDGE_LOG: kvbridge's own log lines on standard error, off unless set."""

import os
import subprocess
import sys

# A listener with a secret refuses a transport without one: the listener's side logs why.
REFUSED = """
import kvbridge
with kvbridge.Engine("tcp", bind="127.0.0.1:0", secret=b"s3cret") as guarded, \\
        kvbridge.Engine("tcp", bind="127.0.0.1:0") as plain:
    try:
        plain.connect(guarded.local_descriptor())
    except kvbridge.KvbridgeError:
        pass
    else:
        raise SystemExit("a transport without the secret was let in")
"""


def run(env_value):
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_LOG"}
    if env_value is not None:
        env["KVBRIDGE_LOG"] = env_value
    return subprocess.run(
        [sys.executable, "-c", REFUSED], env=env, capture_output=True, text=True, timeout=60
    )


def test_the_listeners_reason_is_logged_when_kvbridge_log_is_set():
    r = run("warn")
    assert r.returncode == 0, r.stderr
    assert "rejected an inbound connection" in r.stderr, r.stderr
    assert "WARN" in r.stderr


def test_nothing_is_logged_unless_it_is_set():
    r = run(None)
    assert r.returncode == 0, r.stderr
    assert "rejected an inbound connection" not in r.stderr, r.stderr


def test_a_filter_it_cannot_read_says_so_and_what_it_takes():
    r = run("warn,kvbridge_tcp=loud")
    assert r.returncode == 0, r.stderr
    assert "KVBRIDGE_LOG=" in r.stderr and "is not a log filter" in r.stderr, r.stderr
    assert "rejected an inbound connection" not in r.stderr
