"""UCX RMA between two network namespaces standing in for two nodes."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

NODE = str(Path(__file__).with_name("_netns_node.py"))
#: The programs on the two "nodes" are separate: they share this key.
_AUTHKEY = secrets.token_hex(16)
SIZE = 8 << 20


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_nodes():
    tag = f"{os.getpid() % 10000}"
    a, b = f"gs-a-{tag}", f"gs-b-{tag}"
    va, vb = f"gsva{tag}", f"gsvb{tag}"
    _ip("netns", "add", a)
    _ip("netns", "add", b)
    try:
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, "198.18.0.1/24"), (b, vb, "198.18.0.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, va
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


def _run_in(ns: str, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), GPUSHARE_AUTHKEY=_AUTHKEY)
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, NODE, *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def _reap(*procs: subprocess.Popen | None) -> None:
    """Kill those of ``procs`` still running, wait for them and close their pipes."""
    for proc in procs:
        if proc is None:
            continue
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def _cross(exporter_ns: str, importer_ns: str, export_args: tuple[str, ...], import_role: str,
           extra: dict | None = None) -> tuple[dict, dict, str]:
    """Run an exporter in one namespace and an importer in the other.

    Returns (exporter's hello, importer's result, importer's stderr) after
    checking that the exporter sees the bytes the importer wrote and exits 0.
    """
    exporter = _run_in(exporter_ns, *export_args)
    try:
        line = exporter.stdout.readline()
        assert line, exporter.stderr.read()
        hello = json.loads(line)
        importer = _run_in(importer_ns, import_role)
        out, err = importer.communicate(json.dumps({**hello, **(extra or {})}) + "\n", timeout=120)
        assert importer.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["get_digest"] == hello["digest"]
        exporter.stdin.write("digest\n")
        exporter.stdin.flush()
        assert exporter.stdout.readline().strip() == result["put_digest"]
        exporter.stdin.write("exit\n")
        exporter.stdin.flush()
        assert exporter.wait(30) == 0
        return hello, result, err
    finally:
        _reap(exporter)


def test_put_and_get_across_namespaces(two_nodes):
    a, b, va = two_nodes
    _, result, _ = _cross(b, a, ("export", str(SIZE)), "import", {"size": SIZE})
    # The bytes crossed the "network": over TCP on the veth link.
    assert "tcp" in result["lane"] and va in result["lane"], result["lane"]


def test_region_server_across_namespaces_checks_keys(two_nodes):
    a, b, va = two_nodes
    _, result, _ = _cross(b, a, ("server-export", str(SIZE)), "server-import", {"size": SIZE})
    assert "tcp" in result["lane"] and va in result["lane"], result["lane"]
    # A forged key was refused on the way, and the exporter's bytes are the importer's put alone.
    assert result["refused"] is True


def test_share_opened_across_namespaces_goes_over_ucx_rma(two_nodes):
    a, b, _ = two_nodes
    _, result, err = _cross(b, a, ("share-export", str(SIZE)), "share-open")
    assert "SlowPathWarning" not in err
    assert result["path"] == "ucx-rma"
    assert "another node" in result["why"]


def test_an_ordinary_dict_of_20000_arrays_moves_both_ways_across_namespaces(two_nodes):
    # 20,000 allocations: 20,000 regions and keys, a grant of several MiB in
    # many control frames, gets and puts in paced parts the region server takes.
    a, b, _ = two_nodes
    _, result, _ = _cross(b, a, ("bundle-export", "20000"), "bundle-open")
    assert result["paths"] == ["ucx-rma"]


def test_ucx_rma_isolation_revocation_and_read_only_hold_across_namespaces(two_nodes):
    # Over TCP between two nodes the exporter itself checks every transfer:
    # an importer reaches only what it opened, a revoked share stops at once
    # while its other shares work, read-only refuses writes.
    a, b, _ = two_nodes
    exporter = _run_in(b, "guard-export")
    importer = _run_in(a, "guard-import")
    try:
        importer.stdin.write(exporter.stdout.readline())
        importer.stdin.flush()
        assert json.loads(importer.stdout.readline()) == {"step": "checked"}
        exporter.stdin.write("revoke a\n")
        exporter.stdin.flush()
        assert json.loads(exporter.stdout.readline()) == {"revoked": "a"}
        importer.stdin.write("go\n")
        importer.stdin.flush()
        result = json.loads(importer.stdout.readline())
        exporter.stdin.write("bytes\n")
        exporter.stdin.flush()
        seen = json.loads(exporter.stdout.readline())
        exporter.stdin.write("exit\n")
        exporter.stdin.flush()
        assert importer.wait(60) == 0 and exporter.wait(60) == 0
    finally:
        _reap(importer, exporter)
    assert result["paths"] == {"a": "ucx-rma", "b": "ucx-rma", "ro": "ucx-rma"}
    assert result["own"] == "allowed" and result["put_writable"] == "allowed"
    assert result["other_region_with_own_key"] == "AccessDeniedError"
    assert result["forged_key"] == "AccessDeniedError"
    assert result["past_the_end"] == "OutOfBoundsError"
    assert result["put_read_only"] == "AccessDeniedError"
    assert result["revoked_share"] == "ClosedError"
    assert result["revoked_key_directly"] in ("ClosedError", "AccessDeniedError")
    assert result["other_share_after"] == "allowed" and result["b_bytes"] == [7]
    assert result["closed_views_key"] == "AccessDeniedError"
    assert seen == {"a": [1], "b": [2, 7], "ro": [3]}  # nothing refused was written


def test_two_namespaces_example_runs():
    example = Path(__file__).resolve().parent.parent / "examples" / "two_namespaces.py"
    r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "over ucx-rma" in r.stdout and r.stdout.strip().endswith("ok")
    assert "node b sees node a's write: True" in r.stdout


def test_training_exchange_across_namespaces(two_nodes):
    """The channel example with its producer on node b, two consumers on node
    a (notified over TCP, reading over ucx-rma) and one on node b (host-fd)."""
    a, b, _ = two_nodes
    example = str(Path(__file__).resolve().parent.parent / "examples" / "training_exchange.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), GPUSHARE_AUTHKEY=_AUTHKEY)

    def run(ns: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, example, "--steps", "30",
                                 "--shape", "64,1024", *args], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    producer = run(b, "--role", "producer", "--consumers", "3")
    consumers = []
    try:
        line = producer.stdout.readline()
        assert line.startswith("handle: "), producer.stderr.read()
        consumers = [run(ns, "--role", "consumer") for ns in (a, a, b)]
        for c in consumers:  # all three must join before the first step
            c.stdin.write(line)
            c.stdin.close()
        outs = [(c.stdout.read(), c.stderr.read()) for c in consumers]
        for c in consumers:
            c.wait(60)
        for c, (out, err) in zip(consumers, outs, strict=True):
            assert c.returncode == 0 and out.strip().endswith("ok"), out + err
        reports = sorted(out.splitlines()[0] for out, _ in outs)
        paths = sorted(r.split(" via ")[1] for r in reports)
        assert paths == ["host-fd, zero-copy True", "ucx-rma, zero-copy False", "ucx-rma, zero-copy False"]
        assert all(": 30 steps, 0 wrong, via " in r for r in reports)
        out, err = producer.communicate(timeout=60)
        assert producer.returncode == 0, err
        assert "producer: 30 steps of (64, 1024) float32 on 3 consumers" in out and out.strip().endswith("ok")
    finally:
        _reap(producer, *consumers)


@pytest.mark.parametrize("who_dies", ["consumer", "producer"])
def test_a_process_that_dies_on_the_other_node_breaks_the_channel_within_seconds(two_nodes, who_dies):
    """Across nodes death shows as the end of the channel's TCP connection."""
    a, b, _ = two_nodes
    producer = _run_in(b, "channel-produce-" + ("dies" if who_dies == "producer" else "lives"))
    consumer = None
    try:
        hello = producer.stdout.readline()
        assert hello, producer.stderr.read()
        consumer = _run_in(a, "channel-consume-" + ("dies" if who_dies == "consumer" else "lives"))
        consumer.stdin.write(hello)
        consumer.stdin.flush()
        took = json.loads(consumer.stdout.readline() or "null")
        assert took == {"step": 0, "first": 1, "paths": ["ucx-rma"]}, consumer.stderr.read()
        if who_dies == "consumer":
            assert consumer.wait(30) == 3
            report = json.loads(producer.stdout.readline())
            assert producer.wait(30) == 0
        else:
            producer.stdin.write("go\n")
            producer.stdin.flush()
            assert producer.wait(30) == 0
            consumer.stdin.write("go\n")
            consumer.stdin.flush()
            report = json.loads(consumer.stdout.readline())
            assert consumer.wait(30) == 0
        assert report["error"] == "ChannelBrokenError", report
        assert report["seconds"] < 5
        assert f"{'consumer 0' if who_dies == 'consumer' else 'producer'} (pid" in report["message"]
    finally:
        _reap(producer, consumer)


@pytest.mark.parametrize(("control_host", "expected"), [
    (None, ["127.0.0.1", "198.18.0.1"]),  # every interface, as before
    ("127.0.0.1", ["127.0.0.1"]),
    ("198.18.0.1", ["198.18.0.1"]),
])
def test_ucx_listens_only_where_the_control_channel_does(two_nodes, control_host, expected):
    """UCX's TCP listeners take anyone who reaches them (docs/security.md): with
    GPUSHARE_CONTROL_HOST naming one address, UCX listens on that interface only."""
    a, _, _ = two_nodes
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_CONTROL_HOST", "UCX_NET_DEVICES"))}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if control_host is not None:
        env["GPUSHARE_CONTROL_HOST"] = control_host
    out = subprocess.run(["ip", "netns", "exec", a, sys.executable, NODE, "listens"], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    listening = json.loads(out.strip().splitlines()[-1])
    if control_host is None:  # the control channel listens on 0.0.0.0, UCX on each interface
        assert set(expected) <= set(listening), listening
    else:
        assert listening == expected, listening

