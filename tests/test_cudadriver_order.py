"""CUDA ordering at the edges of a share, against the CUDA driver stand-in
(a contract check, not GPU verification; the ``gpu`` versions run on a GPU).

* A producer's work still queued when it exports (on the stream its array
  names, its current stream through DLPack, or the legacy stream) lands
  before any importer maps the memory, on every mapped path, as
  torch.multiprocessing's IPC events make it do.
* A consumer's work still queued on the mapping (on the legacy stream, a
  blocking stream, or the stream it handed to ``__dlpack__``) completes
  before the memory is unmapped or its IPC handle closed: on a GPU a kernel
  there would fault and poison the context.

On the stand-in queued work runs only when something synchronises: what
gpushare does not wait for shows as old bytes or as an illegal address.
"""

from __future__ import annotations

import pytest

from _procs import Child

pytestmark = pytest.mark.cudadriver

N = 1 << 16


@pytest.fixture
def spawn(standin_peers):
    from _cudadriver_order_peer import setup

    def start() -> Child:
        return standin_peers(setup)

    return start


@pytest.mark.parametrize(("how", "path"), [("cai", "cuda-ipc"), ("legacy", "cuda-ipc"), ("torch", "cuda-ipc"),
                                           ("allocate", "posix-fd")])
def test_work_the_producer_queued_lands_before_the_importer_maps_it(spawn, how, path):
    exporter, importer = spawn(), spawn()
    share = exporter.call("export_with_queued_work", "s", N, 0x42, how)
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == path, opened
    assert importer.call("read_view", "v", N) == b"\x42" * N


@pytest.mark.parametrize(("kind", "consumer"), [("legacy", "cai"), ("blocking", "cai"), ("legacy", "dlpack"),
                                                ("non-blocking", "dlpack")])
@pytest.mark.parametrize("path", ["posix-fd", "cuda-ipc"])
def test_close_waits_for_the_consumers_work_on_the_mapping(spawn, path, kind, consumer):
    exporter, importer = spawn(), spawn()
    if path == "posix-fd":
        exporter.call("allocate", "buf", 2 << 20, 0, None, 0x37)
    else:
        exporter.call("legacy_alloc", "buf", 2 << 20, 0x37)
    opened = importer.call("open_view", "v", exporter.call("export", "buf"))
    assert opened["path"] == path, opened
    seen = importer.call("copy_out_then_close", "v", N, kind, consumer)
    assert seen == {"unmapped": True, "sync": "CUDA_SUCCESS", "bytes": b"\x37" * 8}, seen
