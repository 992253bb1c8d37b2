"""gpushare as a Ray tensor transport (gpushare.ray), with a real local Ray.

One Ray instance for the module (about 10 s to start), long-lived actors;
each test checks what arrived (values, dtype, shape), over which path, what
the source still exports, and who may open it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra: gpushare.ray carries torch tensors: pip install torch")
pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'gpushare[ray]' (the tests run a local Ray)")

import ray
from ray.experimental.rdt.util import get_tensor_transport_manager

import gpushare as gs
import gpushare.ray as gsray
from gpushare import _auth

pytestmark = pytest.mark.timeout(180)


def _fingerprint() -> str:
    return hashlib.sha256(_auth.key()).hexdigest()


def _wait(what, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def _actor_classes():
    """The actors, defined once the transports are registered (``@ray.method``
    checks the transport's name when the class is made)."""

    @ray.remote(enable_tensor_transport=True, num_cpus=0)
    class Source:
        """Holds a plain torch tensor and one over gpushare memory; returns them through the transports."""

        def __init__(self):
            self.plain = torch.arange(6, dtype=torch.float32).reshape(2, 3)
            self.pooled = torch.from_dlpack(gs.empty(8, "int64"))  # gpushare.allocate memory: host-fd
            self.pooled[:] = torch.arange(8) * 10

        @ray.method(tensor_transport="gpushare")
        def tensors(self):
            return {
                "plain": self.plain,
                "pooled": self.pooled,
                "bf16": torch.full((3, 2), 1.5, dtype=torch.bfloat16),
                "flags": torch.tensor([True, False, True]),
                "column": torch.arange(12, dtype=torch.int16).reshape(3, 4)[:, 1],  # not contiguous
                "scalar": torch.tensor(7.25, dtype=torch.float64),
                "nothing": torch.zeros((2, 0)),
            }

        @ray.method(tensor_transport="gpushare")
        def one(self, n: int):
            return torch.full((n,), 3, dtype=torch.int32)

        @ray.method(tensor_transport="gpushare_zc")
        def mapped(self):
            return {"pooled": self.pooled, "plain": self.plain}

        def bump(self):
            self.pooled += 1
            self.plain += 1

        @ray.method(tensor_transport="gpushare")
        def kept(self):
            self.held = torch.full((4,), 2.5)  # kept here after it is returned
            return self.held

        def wait_freed(self, timeout):
            """ray.experimental.wait_tensor_freed on the kept tensor; then what the transport revoked."""
            ray.experimental.wait_tensor_freed(self.held, timeout=timeout)
            return gsray.stats()["revoked"]

        def exported(self):
            return gsray.exported()

        def stats(self):
            return gsray.stats()

        def fingerprint(self):
            return _fingerprint(), type(get_tensor_transport_manager("GPUSHARE"))._key is not None


    @ray.remote(enable_tensor_transport=True, num_cpus=0)
    class Sink:
        def __init__(self):
            self.kept = None

        def describe(self, tree):
            if isinstance(tree, torch.Tensor):
                tree = {"t": tree}
            return {k: (v.tolist(), v.dtype, tuple(v.shape), v.is_contiguous()) for k, v in tree.items()}

        def keep(self, tree):
            self.kept = tree
            return sorted(tree)

        def read(self):
            return {k: v.tolist() for k, v in self.kept.items()}

        def drop(self):
            self.kept = None

        def fetch(self, refs):  # ray.get in the actor: the one-sided fetch path
            return ray.get(refs[0]).tolist()

        def stats(self):
            return gsray.stats()

        def fingerprint(self):
            return _fingerprint()

        def spoil_key(self):
            """Make the transport here, then replace its key with another."""
            _wait("the transport registered here", lambda: "GPUSHARE" in ray.experimental.rdt.util.transport_manager_info)
            get_tensor_transport_manager("GPUSHARE")
            gs.set_authkey(b"not the job's key, 32 bytes long")

    return Source, Sink


@pytest.fixture(scope="module")
def actors():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this file
    assert gsray.register() == "GPUSHARE"
    assert gsray.register("gpushare_zc", zero_copy=True) == "GPUSHARE_ZC"
    Source, Sink = _actor_classes()
    # Every worker registers the transports at its start (gpushare.ray.runtime_env), as docs/ray.md says.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=gsray.runtime_env())
    try:
        source, sink, spoiled = Source.remote(), Sink.remote(), Sink.remote()
        ray.get([source.stats.remote(), sink.stats.remote(), spoiled.stats.remote()], timeout=120)
        yield source, sink, spoiled
    finally:
        ray.shutdown()
        gs.set_authkey(None)  # register() set this process's key: the other test files expect the default


def test_import_gpushare_does_not_import_ray():
    code = "import sys, gpushare; assert 'ray' not in sys.modules and 'gpushare.ray' not in sys.modules; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_zero_copy_goes_over_the_paths_whose_mapping_holds_the_memory():
    from gpushare import _paths

    assert all(isinstance(p.holds_memory, bool) and (p.mapped or not p.holds_memory) for p in _paths.PATHS)
    assert gsray.ZERO_COPY_PATHS == {"same-process", "host-fd", "posix-fd", "fabric"}  # not cuda-ipc


def test_register_checks_keys_and_is_idempotent(actors):
    assert gsray.register() == "GPUSHARE"  # again: nothing changes
    key = type(get_tensor_transport_manager("GPUSHARE"))._key
    assert _auth.key() == key and len(key) == 32
    with pytest.raises(gs.InvalidInputError, match="at least 16 bytes"):
        gsray.register("other", key=b"short")
    with pytest.raises(ValueError, match="another key"):
        gsray.register("other", key=b"x" * 32)
    with pytest.raises(ValueError, match="already registered"):
        gsray.register(key=key)
    assert _auth.key() == key  # none of the refusals touched this process's key


def test_the_key_travels_in_the_class_by_value_and_every_process_holds_it(actors):
    source, sink, _ = actors
    cls = type(get_tensor_transport_manager("GPUSHARE"))
    blob = ray.cloudpickle.dumps(cls)
    assert cls._key in blob  # pickled by value: the key is in what Ray sends
    assert "<locals>" in cls.__qualname__
    ray.get(sink.describe.remote(source.one.remote(2)), timeout=60)  # both have used the transport
    src_print, has_class_key = ray.get(source.fingerprint.remote(), timeout=30)
    assert has_class_key
    assert src_print == ray.get(sink.fingerprint.remote(), timeout=30) == _fingerprint()


def test_tensors_of_one_call_arrive_as_one_bundle(actors):
    source, sink, _ = actors
    before_src, before_sink = ray.get(source.stats.remote()), ray.get(sink.stats.remote())
    ref = source.tensors.remote()
    got = ray.get(sink.describe.remote(ref), timeout=60)
    assert got["plain"] == ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], torch.float32, (2, 3), True)
    assert got["pooled"] == ([i * 10 for i in range(8)], torch.int64, (8,), True)
    assert got["bf16"] == ([[1.5, 1.5]] * 3, torch.bfloat16, (3, 2), True)
    assert got["flags"] == ([True, False, True], torch.bool, (3,), True)
    assert got["column"] == ([1, 5, 9], torch.int16, (3,), True)
    assert got["scalar"] == (7.25, torch.float64, (), True)
    assert got["nothing"] == ([[], []], torch.float32, (2, 0), True)
    src, dst = ray.get(source.stats.remote()), ray.get(sink.stats.remote())
    assert src["exported"] == before_src["exported"] + 1  # seven tensors, one export
    share = ray.get(source.exported.remote())[ref.hex()]
    assert isinstance(share, gs.BundleShare) and share.count == 6  # the six with elements, one bundle
    assert dst["received"] == before_sink["received"] + 1
    # torch's own memory goes over cma, gpushare memory over host-fd; copies by default
    paths = {p: dst["paths"].get(p, 0) - before_sink["paths"].get(p, 0) for p in ("cma", "host-fd")}
    assert paths == {"cma": 5, "host-fd": 1}
    assert dst["copied"] - before_sink["copied"] == 6 and dst["zero_copy"] == before_sink["zero_copy"]
    del ref


def test_freed_ref_revokes_the_share(actors):
    source, sink, _ = actors
    ref = source.one.remote(5)
    assert ray.get(sink.describe.remote(ref), timeout=60)["t"][0] == [3] * 5
    live = ray.get(source.exported.remote())
    (obj_id,) = [k for k in live if k == ref.hex()]
    share = live[obj_id]
    with gs.open(share) as bundle:  # the driver holds the job's key: it may open it while the ref lives
        assert bundle.paths == ("cma",) and bundle.get()[0].tolist() == [3] * 5
    revoked = ray.get(source.stats.remote())["revoked"]
    del ref
    _wait("the share revoked after the ref was freed", lambda: ray.get(source.stats.remote())["revoked"] > revoked)
    assert obj_id not in ray.get(source.exported.remote())
    with pytest.raises(gs.ClosedError):
        gs.open(share)


def test_wait_tensor_freed_returns_once_the_ref_is_gone_and_the_share_is_revoked(actors):
    source, sink, _ = actors
    ref = source.kept.remote()
    assert ray.get(sink.describe.remote(ref), timeout=60)["t"][0] == [2.5] * 4
    revoked = ray.get(source.stats.remote())["revoked"]
    with pytest.raises(TimeoutError, match="not freed"):  # the ref still lives (a RayTaskError that is one)
        ray.get(source.wait_freed.remote(0.5), timeout=60)
    del ref
    ray.get(source.wait_freed.remote(30), timeout=60)
    _wait("the kept tensor's share revoked", lambda: ray.get(source.stats.remote())["revoked"] > revoked)


@ray.remote(enable_tensor_transport=True, num_cpus=0)
class _Putter:
    """A fresh actor whose first act is a ray.put through the transport."""

    def put_first(self, n):
        try:
            ref = ray.put(torch.arange(n, dtype=torch.int32), _tensor_transport="gpushare")
        except Exception as exc:  # noqa: BLE001 - reported to the test, which counts them
            return f"{type(exc).__name__}: {exc}"
        return ray.get(ref).tolist(), gsray.stats()["exported"], ref.hex() in gsray.exported()


def test_ray_put_is_the_first_thing_twenty_fresh_actors_do_and_all_of_them_succeed(actors):
    # Ray sends a custom transport to a new actor in a task of its own that runs
    # beside the actor's methods: without the setup hook of gpushare.ray.runtime_env
    # most of these fail with "Invalid tensor transport: GPUSHARE".
    putters = [_Putter.remote() for _ in range(20)]
    try:
        got = ray.get([p.put_first.remote(k + 1) for k, p in enumerate(putters)], timeout=170)
    finally:
        for p in putters:
            ray.kill(p)
    failed = [g for g in got if isinstance(g, str)]
    assert not failed, f"{len(failed)} of 20 failed: {sorted(set(failed))}"
    # Each put went through gpushare (one export, live while its ref is) and reads back.
    assert got == [(list(range(k + 1)), 1, True) for k in range(20)]


def test_runtime_env_needs_a_transport_and_keeps_the_jobs_other_settings(actors):
    env = gsray.runtime_env({"env_vars": {"A": "1"}, "worker_process_setup_hook": "json.dumps"})
    assert env["env_vars"] == {"A": "1"} and callable(env["worker_process_setup_hook"])
    blob = ray.cloudpickle.dumps(env["worker_process_setup_hook"])
    assert type(get_tensor_transport_manager("GPUSHARE"))._key in blob  # the classes travel by value
    with pytest.raises(TypeError, match="worker_process_setup_hook must be a callable"):
        gsray.runtime_env({"worker_process_setup_hook": 3})
    code = "import gpushare.ray as g\ntry:\n    g.runtime_env()\nexcept ValueError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("no gpushare transport is registered in this process: call gpushare.ray.register()")


def test_ray_put_in_the_driver_and_get_in_an_actor_and_in_the_driver(actors):
    source, sink, _ = actors
    tensor = torch.linspace(0, 1, 11, dtype=torch.float32)
    ref = ray.put(tensor, _tensor_transport="gpushare")
    assert ref.hex() in gsray.exported()  # the driver is the source
    assert ray.get(sink.fetch.remote([ref]), timeout=60) == tensor.tolist()
    share = gsray.exported()[ref.hex()]
    del ref
    _wait("the driver's share revoked", lambda: share.share_id not in {s.share_id for s in gsray.exported().values()})
    with pytest.raises(gs.ClosedError):
        gs.open(share)
    # the driver as receiver: ray.get of an actor's object
    before = gsray.stats()["received"]
    assert ray.get(source.one.remote(3), timeout=60).tolist() == [3, 3, 3]
    assert gsray.stats()["received"] == before + 1


def test_target_buffers_are_copied_into(actors):
    from ray.experimental import set_target_for_ref

    source, _, _ = actors
    ref = source.one.remote(4)
    target = torch.zeros(4, dtype=torch.int32)
    set_target_for_ref(ref, [target])
    got = ray.get(ref, timeout=60)
    assert got.data_ptr() == target.data_ptr() and target.tolist() == [3] * 4


def test_copies_hold_the_values_of_the_transfer(actors):
    source, sink, _ = actors
    ref = source.tensors.remote()
    ray.get(sink.keep.remote(ref), timeout=60)
    ray.get(source.bump.remote())
    kept = ray.get(sink.read.remote())
    assert kept["pooled"] == [i * 10 for i in range(8)]  # not the source's later write
    ray.get(sink.drop.remote())


def test_zero_copy_maps_gpushare_memory_and_copies_the_rest(actors):
    source, sink, _ = actors
    before = ray.get(sink.stats.remote())
    ref = source.mapped.remote()
    ray.get(sink.keep.remote(ref), timeout=60)
    first = ray.get(sink.read.remote())
    after = ray.get(sink.stats.remote())
    assert after["zero_copy"] - before["zero_copy"] == 1 and after["copied"] - before["copied"] == 1
    ray.get(source.bump.remote())
    bumped = ray.get(sink.read.remote())
    assert bumped["pooled"] == [v + 1 for v in first["pooled"]]  # the source's memory, mapped
    assert bumped["plain"] == first["plain"]  # cma: a copy
    # Ray frees the object, the share is revoked: the mapping stays valid
    revoked = ray.get(source.stats.remote())["revoked"]
    del ref
    _wait("the zero-copy share revoked", lambda: ray.get(source.stats.remote())["revoked"] > revoked)
    assert ray.get(sink.read.remote())["pooled"] == bumped["pooled"]
    ray.get(sink.drop.remote())


def test_a_process_without_the_key_is_refused(actors):
    source, _, spoiled = actors
    ref = source.one.remote(2)
    share = _wait("the share", lambda: ray.get(source.exported.remote()).get(ref.hex()))
    # a process outside the job (its own key) that holds the share
    code = textwrap.dedent("""
        import sys
        import gpushare as gs
        share = gs.Share.from_bytes(sys.stdin.buffer.read())
        try:
            gs.open(share)
        except gs.AccessDeniedError as exc:
            print("refused:", exc)
        else:
            print("opened")
    """)
    env = {k: v for k, v in os.environ.items() if k != "GPUSHARE_AUTHKEY"}
    r = subprocess.run([sys.executable, "-c", code], check=False, input=share.to_bytes(), capture_output=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().startswith("refused:") and "GPUSHARE_AUTHKEY" in r.stdout.decode()
    # an actor of the job whose key was replaced: its receive fails, the task says why
    ray.get(spoiled.spoil_key.remote(), timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError, match="AccessDeniedError"):
        ray.get(spoiled.describe.remote(ref), timeout=60)


def test_receive_refuses_an_aborted_transfer_and_metadata_that_does_not_match(actors):
    source, sink, _ = actors
    manager = get_tensor_transport_manager("GPUSHARE")
    assert manager.actor_has_tensor_transport(sink) and manager.actor_has_tensor_transport(source)
    ref = ray.put([torch.arange(3), torch.ones(2)], _tensor_transport="gpushare")
    meta = ray._private.worker.global_worker.rdt_manager.get_rdt_metadata(ref.hex()).tensor_transport_meta
    assert isinstance(meta, gsray.GpushareTransportMetadata) and meta.share.count == 2
    comm = manager.get_communicator_metadata(None, None)
    got = manager.recv_multiple_tensors("some object", meta, comm)
    assert [t.tolist() for t in got] == [[0, 1, 2], [1.0, 1.0]]
    manager.abort_transport("aborted object", comm)
    with pytest.raises(RuntimeError, match="aborted"):
        manager.recv_multiple_tensors("aborted object", meta, comm)
    assert len(manager.recv_multiple_tensors("aborted object", meta, comm)) == 2  # an abort refuses once
    wrong = gsray.GpushareTransportMetadata(tensor_meta=meta.tensor_meta[:1], tensor_device="cpu", share=meta.share,
                                            carried=(0,))
    with pytest.raises(gs.InvalidInputError, match="do not match"):
        manager.recv_multiple_tensors("some object", wrong, comm)
    del ref


def _cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return "this torch has no CUDA device (CPU build, or no GPU)"
    return None


@pytest.mark.gpu
@pytest.mark.kernels
def test_cuda_tensors_between_two_actors(actors):
    if _cuda_reason():
        pytest.skip(_cuda_reason())

    @ray.remote(enable_tensor_transport=True, num_gpus=0.5, num_cpus=0)
    class CudaSource:
        def __init__(self):
            self.pooled = torch.from_dlpack(gs.empty(1024, "float32", device=0))  # posix-fd
            self.pooled[:] = 2.5

        @ray.method(tensor_transport="gpushare")
        def tensors(self):
            return {"plain": torch.arange(1000, device="cuda", dtype=torch.float16), "pooled": self.pooled}

    @ray.remote(enable_tensor_transport=True, num_gpus=0.5, num_cpus=0)
    class CudaSink:
        def describe(self, tree):
            return ({k: (v.device.type, v.dtype, v.cpu().tolist()) for k, v in tree.items()}, gsray.stats()["paths"])

    src, dst = CudaSource.remote(), CudaSink.remote()
    got, paths = ray.get(dst.describe.remote(src.tensors.remote()), timeout=120)
    assert got["plain"] == ("cuda", torch.float16, [float(i) for i in range(1000)])
    assert got["pooled"] == ("cuda", torch.float32, [2.5] * 1024)
    assert paths == {"cuda-ipc": 1, "posix-fd": 1}
    # a CUDA object fetched into a host buffer
    ref = src.tensors.remote()
    host = [torch.empty(1000, dtype=torch.float16), torch.empty(1024, dtype=torch.float32)]
    from ray.experimental import set_target_for_ref

    set_target_for_ref(ref, host)
    ray.get(ref, timeout=120)
    assert host[0].tolist() == [float(i) for i in range(1000)] and host[1].tolist() == [2.5] * 1024


def test_without_ray_the_module_says_which_extra_to_install():
    code = ("import sys; sys.modules['ray'] = None\n"
            "try:\n    import gpushare.ray\nexcept ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'gpushare[ray]'" in out.stdout, out.stdout + out.stderr
