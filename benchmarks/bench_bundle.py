"""Bundles: many tensors handed to another process as one share, side by side
with one share per tensor and with torch.multiprocessing, in the same run.

0. Ordinary state dicts, every tensor an allocation of its own (as
   ``torch.ones``, ``np.ones`` or a loaded checkpoint give them), handed to
   the second process, from "here is the dict" to usable tensors there:
   ``gs.export`` of the dict, then ``gs.open`` + ``bundle.get()`` (cma,
   each allocation copied; fresh tensors of the exporter's kind), and
   ``gs.share_memory`` of the dict first (its copy counted), then
   ``np.asarray`` of every view (one host-fd mapping), against
   ``torch.multiprocessing`` with the same dict as torch tensors (its Queue's
   put moves each storage into shared memory, as torch does for a tensor not
   shared yet), the consumer making ``tensor.numpy()`` of each.  Cases: a
   Llama-2-7B-shaped dict of torch CPU tensors (widths /16, all 32 layers:
   291 tensors), 5,000 torch CPU tensors of 256 B, and 20,000 NumPy arrays of
   256 B.  Targets: at least 1x torch.multiprocessing for the Llama-shaped
   dict and 3x for the 5,000 tensors; at least 10x for the 20,000 arrays
   through ``gs.share_memory``; at most 50 ms from ``gs.open`` to a view of
   every one of them.  ``--ordinary-only`` runs only this section,
   ``--carved-only`` leaves it out.

Workloads of the sections below (host memory), each tensor a view into one of a few
``gs.empty`` buffers of 64 MiB (a new buffer when the next tensor does not
fit), as an allocator hands out tensors:

* a state dict shaped like Llama-2-7B (its published ``config.json``),
  scaled down: hidden and intermediate size and heads divided by 8, layers by
  4, vocabulary kept (float16, the size of its bfloat16 weights);
* a flat dict of K tensors of 64 float32 each, K = 1,000 and 20,000.

1. Hand-over: from "here are the tensors" in this process to usable NumPy
   arrays in a second (spawned, already running) process, clocked with
   CLOCK_MONOTONIC on both sides:

   * (a) one bundle: ``gs.export(tree)``, pickle, send over a pipe, unpickle,
     ``gs.open``, then either ``bundle.get()`` (fresh arrays: every byte
     copied) or ``numpy.asarray`` of every view of ``bundle.tree()``
     (zero-copy over the mapped buffer);
   * (b) one share per tensor: ``gs.export`` of each, one pickle of the dict
     of shares, ``gs.open`` of each and ``numpy.asarray`` of each view;
   * (c) torch.multiprocessing: the dict of CPU tensors, already in shared
     memory before the clock starts (``share_memory_()``, as
     ``model.share_memory()`` does), put on a ``torch.multiprocessing``
     Queue; the consumer takes it and makes ``tensor.numpy()`` of each.  Once
     with one storage per tensor (as ``nn.Module`` parameters are), once with
     views of the same 64 MiB arenas as gpushare's.  Sharing strategy
     ``file_system`` in both processes (``file_descriptor``, torch's default,
     needs an fd per storage and fails with EMFILE at 20,000).

   Every consumer reads one element of every tensor before it stops the
   clock; each run allocates its tensors anew (outside the clock), and the
   consumers have made one hand-over of every kind before the first run
   (imports done, connection to the exporter made).  Between hand-overs
   every process runs ``gc.collect()`` and the benchmark waits (at most 5 s)
   until its processes have been idle for 50 ms, so that what one left
   behind (a full collection over 20,000 views, freeing 20,000 tensors,
   torch's shm manager unlinking their files) is not timed in the next; a
   collection the hand-over's own objects set off is timed.
2. Opening: ``gs.open`` of the bundle alone (from the runs above); a further
   ``gs.open`` of a single small share (the connection made) next to
   attaching a ``multiprocessing.shared_memory`` segment (the floor): of a
   ``lifetime="revoked"`` share (each open reopens the view closed before
   it, with no message: docs/lifetimes.md) and of an ``"auto"`` one (each
   open a round trip to the exporter).
3. Bytes per tensor of the pickled bundle share.
4. Across two network namespaces (root and iproute2; one veth pair,
   198.18.7.1 and 198.18.7.2, deleted on the way out, also on an error or
   SIGTERM): the exporter a program in one (``GPUSHARE_CONTROL_HOST`` its veth
   address), the importer one in the other, sharing ``GPUSHARE_AUTHKEY``.
   The 20,000-tensor bundle (the target) and the model state dict, opened
   over ucx-rma: ``bundle.get()`` (and ``bundle.get(dests)``) against one
   ``view.get(out)`` of a single share of one buffer of the same bytes, and
   that get followed by one NumPy array per tensor over its bytes, made one
   at a time in Python (fresh arrays the plain way; ``bundle.get()`` makes a
   run of same-shaped tensors in one step).

Every figure is the median of ``--runs`` runs (lowest-highest in
parentheses).  Targets are printed with the measured value and PASS or
BELOW.  ``--profile`` adds cProfile listings of the consumer's 20,000-tensor
hand-over, of the export, and of a ``bundle.get()`` over ucx-rma.

``--allocator arena`` makes gpushare's tensors with ``gs.Arena.empty``
(the same 64 MiB chunks) instead of slicing ``gs.empty`` buffers.

Run: ``python benchmarks/bench_bundle.py [--runs 5] [--quick] [--profile] [--no-netns | --netns-only] [--allocator arena]``
(about two minutes by default on two cores).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import math
import multiprocessing as mp
import os
import pickle
import pstats
import resource
import secrets
import select
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from multiprocessing import shared_memory
from typing import Any

try:  # before gpushare loads UCX: torch imported after it aborts the process
    import torch
    import torch.multiprocessing as tmp
except ImportError:  # the torch rows say so
    torch = tmp = None

import numpy as np
from _report import spread
from bench_exchange import _netns_unavailable, _Program, _two_nodes

import gpushare as gs

MiB = 1 << 20
#: Size of one allocation the tensors are carved from (a larger tensor gets one of its own).
ARENA = 64 * MiB
ALIGN = 256
TORCH_STRATEGY = "file_system"
#: Seconds a program in a namespace may take.
NODE_TIMEOUT = 300

# Llama-2-7B, meta-llama/Llama-2-7b-hf config.json: hidden_size 4096, intermediate_size 11008,
# num_attention_heads 32, num_key_value_heads 32, num_hidden_layers 32, vocab_size 32000,
# tie_word_embeddings false (embed_tokens and lm_head are two tensors).
LLAMA2_7B = {"hidden": 4096, "intermediate": 11008, "heads": 32, "kv_heads": 32, "layers": 32, "vocab": 32000}


# -- workloads ------------------------------------------------------------------------


def llama_spec(width_div: int, layer_div: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, dtype) of a Llama state dict, widths / ``width_div``, layers / ``layer_div``."""
    c = LLAMA2_7B
    h, inter = c["hidden"] // width_div, c["intermediate"] // width_div
    heads, kv_heads = c["heads"] // width_div, c["kv_heads"] // width_div
    head_dim = h // heads
    spec = [("model.embed_tokens.weight", (c["vocab"], h))]
    for layer in range(c["layers"] // layer_div):
        p = f"model.layers.{layer}."
        spec += [(p + "self_attn.q_proj.weight", (heads * head_dim, h)),
                 (p + "self_attn.k_proj.weight", (kv_heads * head_dim, h)),
                 (p + "self_attn.v_proj.weight", (kv_heads * head_dim, h)),
                 (p + "self_attn.o_proj.weight", (h, heads * head_dim)),
                 (p + "mlp.gate_proj.weight", (inter, h)),
                 (p + "mlp.up_proj.weight", (inter, h)),
                 (p + "mlp.down_proj.weight", (h, inter)),
                 (p + "input_layernorm.weight", (h,)),
                 (p + "post_attention_layernorm.weight", (h,))]
    spec += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab"], h))]
    return [(k, s, "float16") for k, s in spec]


def flat_spec(count: int) -> list[tuple[str, tuple[int, ...], str]]:
    """``count`` tensors of 64 float32, named like per-expert biases of a mixture-of-experts model."""
    return [(f"model.layers.{i // 64}.mlp.experts.{i % 64}.bias", (64,), "float32") for i in range(count)]


def spec_named(name: str) -> list[tuple[str, tuple[int, ...], str]]:
    """``flat:K`` or ``llama:WIDTH_DIV:LAYER_DIV``."""
    kind, *nums = name.split(":")
    return flat_spec(int(nums[0])) if kind == "flat" else llama_spec(int(nums[0]), int(nums[1]))


def title_of(name: str) -> str:
    kind, *nums = name.split(":")
    if kind == "flat":
        return f"flat dict of {int(nums[0]):,} x 64 float32"
    return f"Llama-2-7B shape, widths /{nums[0]}, layers /{nums[1]}, float16"


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _carve(spec: list, new_buffer: Any, view: Any) -> tuple[dict, list]:
    """Tensors of ``spec`` carved from buffers of ARENA bytes: (dict of tensors, the buffers)."""
    tree, buffers, used, size = {}, [], 0, 0
    for key, shape, dtype in spec:
        n = _nbytes(shape, dtype)
        if not buffers or used + n > size:
            size = max(ARENA, n)
            buffers.append(new_buffer(size))
            used = 0
        tree[key] = view(buffers[-1], used, n, shape, dtype)
        used = -(-(used + n) // ALIGN) * ALIGN
    return tree, buffers


def _pattern(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) % 251).astype(np.uint8)


#: How gpushare's tensors are allocated: "views" (slices of gs.empty buffers) or "arena" (gs.Arena.empty).
ALLOCATOR = "views"


def gs_tree(spec: list) -> tuple[dict, int]:
    """The tensors in few shareable buffers, filled (their pages exist before the clock): (tensors, buffers)."""
    if ALLOCATOR == "arena":
        arena = gs.Arena(chunk_size=ARENA)
        tree = {k: arena.empty(shape, dtype) for k, shape, dtype in spec}
        for a in tree.values():
            a.reshape(-1).view(np.uint8)[:] = _pattern(a.nbytes)
        return tree, arena.stats()["chunks"]

    def new(size: int) -> np.ndarray:
        buf = gs.empty(size, "uint8")
        buf[:] = _pattern(size)
        return buf

    tree, buffers = _carve(spec, new, lambda buf, off, n, shape, dtype: buf[off:off + n].view(dtype).reshape(shape))
    return tree, len(buffers)


def torch_tree(spec: list, arenas: bool) -> dict:
    """The tensors in shared memory: one storage each, or views of shared arenas."""
    if not arenas:
        return {k: torch.ones(s, dtype=getattr(torch, d)).share_memory_() for k, s, d in spec}

    def new(size: int) -> Any:
        return torch.ones(size, dtype=torch.uint8).share_memory_()

    return _carve(spec, new, lambda buf, off, n, shape, dtype: buf[off:off + n].view(getattr(torch, dtype))
                  .view(shape))[0]


def _samples(keys: list[str]) -> list[str]:
    return sorted({keys[0], keys[len(keys) // 2], keys[-1]})


def _digests(arrays: dict, keys: list[str]) -> dict:
    return {k: hashlib.sha256(np.ascontiguousarray(arrays[k]).tobytes()).hexdigest() for k in keys}


def _touch(arrays: Any) -> None:
    for a in arrays:
        a.reshape(-1)[0]  # NumPy arrays and torch tensors alike


def ordinary_tree(spec: list, kind: str) -> dict:
    """An ordinary state dict: every tensor an allocation of its own (``torch.ones`` or ``np.ones``),
    filled with a pattern before the clock starts."""
    tree: dict = {}
    for key, shape, dtype in spec:
        arr = np.ones(shape, dtype)
        arr.reshape(-1).view(np.uint8)[:] = _pattern(arr.nbytes)
        tree[key] = torch.from_numpy(arr).clone() if kind == "torch" else arr
    return tree


# -- the consumers ----------------------------------------------------------------------


def _c_bundle(blob: bytes, how: str, samples: list[str]) -> dict:
    t0 = time.monotonic()
    share = pickle.loads(blob)
    t1 = time.monotonic()
    bundle = gs.open(share)
    t2 = time.monotonic()
    views = t2
    if how == "get":
        arrays = bundle.get()
    else:
        tree = bundle.tree()
        views = time.monotonic()
        arrays = {k: np.asarray(v) for k, v in tree.items()}
    _touch(arrays.values())
    t3 = time.monotonic()
    out = {"unpickle": t1 - t0, "open": t2 - t1, "use": t3 - t2, "end": t3, "count": len(arrays),
           "views": views - t2,
           "paths": sorted(set(bundle.paths)), "digests": _digests(arrays, samples)}
    del arrays
    bundle.close()
    return out


def _c_shares(blob: bytes, samples: list[str]) -> dict:
    t0 = time.monotonic()
    shares = pickle.loads(blob)
    t1 = time.monotonic()
    views = {k: gs.open(s) for k, s in shares.items()}
    t2 = time.monotonic()
    arrays = {k: np.asarray(v) for k, v in views.items()}
    _touch(arrays.values())
    t3 = time.monotonic()
    out = {"unpickle": t1 - t0, "open": t2 - t1, "use": t3 - t2, "end": t3, "count": len(arrays),
           "paths": sorted({v.path for v in views.values()}), "digests": _digests(arrays, samples)}
    del arrays
    for v in views.values():
        v.close()
    return out


def _c_single(blob: bytes, reps: int) -> dict:
    share = pickle.loads(blob)
    gs.open(share).close()
    opens, usable = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        view = gs.open(share)
        t1 = time.perf_counter()
        np.asarray(view).flat[0]
        t2 = time.perf_counter()
        opens.append(t1 - t0)
        usable.append(t2 - t0)
        view.close()
    return {"open": opens, "usable": usable, "path": view.path}


def _c_shm(name: str, size: int, reps: int) -> dict:
    usable = []
    for _ in range(reps):
        t0 = time.perf_counter()
        shm = shared_memory.SharedMemory(name=name)
        np.ndarray((size,), np.uint8, buffer=shm.buf).flat[0]
        usable.append(time.perf_counter() - t0)
        shm.close()  # the creator unlinks it (and unregisters it from the tracker this process shares)
    return {"usable": usable}


def _c_profile(blob: bytes, single: bytes, reps: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    bundle = gs.open(pickle.loads(blob))
    arrays = bundle.get()
    prof.disable()
    count = len(arrays)
    del arrays
    bundle.close()
    share = pickle.loads(single)
    gs.open(share).close()
    again = cProfile.Profile()
    for _ in range(reps):
        again.enable()
        view = gs.open(share)
        again.disable()
        view.close()
    return (_top(prof, f"unpickle + gs.open + bundle.get() of {count:,} tensors (consumer)") + "\n\n"
            + _top(again, f"{reps} further gs.open of one share (consumer)", sort="cumulative"))


def _top(prof: cProfile.Profile, what: str, lines: int = 14, sort: str = "tottime") -> str:
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats(sort).print_stats(lines)
    body = text.getvalue()
    start = body.find("   ncalls")
    return (f"cProfile of {what}: {stats.total_tt * 1e3:.1f} ms under the profiler, by "
            f"{'own' if sort == 'tottime' else 'cumulative'} time:\n" + (body[start:] if start >= 0 else body).rstrip())


CONSUMER_OPS = {"bundle": _c_bundle, "shares": _c_shares, "single": _c_single, "shm": _c_shm, "profile": _c_profile}


def _gs_consumer(conn) -> None:
    warnings.simplefilter("ignore", gs.SlowPathWarning)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        reply = CONSUMER_OPS[msg[0]](*msg[1:])
        gc.collect()  # what this hand-over left is collected before the next one's clock starts
        conn.send(reply)


def _torch_consumer(queue, conn) -> None:
    tmp.set_sharing_strategy(TORCH_STRATEGY)
    while True:
        tensors = queue.get()
        if tensors is None:
            return
        t0 = time.monotonic()
        arrays = {k: t.numpy() for k, t in tensors.items()}
        _touch(arrays.values())
        t1 = time.monotonic()
        count = len(arrays)
        del arrays, tensors  # before the reply: the next run does not share the CPUs with this
        gc.collect()
        conn.send({"use": t1 - t0, "end": t1, "count": count})


# -- the producer: one hand-over of each kind ------------------------------------------------


class Runner:
    """This process exports; a spawned gpushare consumer and a spawned torch consumer receive."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.gs_proc = ctx.Process(target=_gs_consumer, args=(child,), daemon=True)
        self.gs_proc.start()
        self.torch_proc = None
        if torch is not None:
            tmp.set_sharing_strategy(TORCH_STRATEGY)
            tctx = tmp.get_context("spawn")
            self.queue = tctx.Queue()
            self.tconn, tchild = tctx.Pipe()
            self.torch_proc = tctx.Process(target=_torch_consumer, args=(self.queue, tchild), daemon=True)
            self.torch_proc.start()

    def ask(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self.conn.recv()

    def _check(self, got: dict, tree: dict, samples: list[str], what: str) -> None:
        if got["count"] != len(tree) or got["digests"] != _digests(tree, samples):
            raise SystemExit(f"{what}: the consumer received other tensors than were sent")

    def bundle(self, spec: list, how: str) -> dict:
        tree, buffers = gs_tree(spec)
        samples = _samples(list(tree))
        t0 = time.monotonic()
        share = gs.export(tree, lifetime="revoked")
        t1 = time.monotonic()
        blob = pickle.dumps(share)
        t2 = time.monotonic()
        got = self.ask("bundle", blob, how, samples)
        share.revoke()
        self._check(got, tree, samples, f"bundle ({how})")
        return {**got, "total": got["end"] - t0, "export": t1 - t0, "pickle": t2 - t1, "parts": buffers,
                "bytes": len(blob)}

    def shares(self, spec: list) -> dict:
        tree, _ = gs_tree(spec)
        samples = _samples(list(tree))
        t0 = time.monotonic()
        shares = {}
        try:
            for k, v in tree.items():
                shares[k] = gs.export(v, lifetime="revoked")
            t1 = time.monotonic()
            blob = pickle.dumps(shares)
            t2 = time.monotonic()
            got = self.ask("shares", blob, samples)
        finally:
            for s in shares.values():
                s.revoke()
        self._check(got, tree, samples, "share per tensor")
        return {**got, "total": got["end"] - t0, "export": t1 - t0, "pickle": t2 - t1}

    def ordinary(self, spec: list, kind: str, layout: bool, how: str) -> dict:
        """An ordinary dict handed over as one bundle (``layout``: through
        ``gs.share_memory`` first, its copy counted)."""
        tree = ordinary_tree(spec, kind)
        samples = _samples(list(tree))
        t0 = time.monotonic()
        sent = gs.share_memory(tree) if layout else tree
        share = gs.export(sent, lifetime="revoked")
        t1 = time.monotonic()
        blob = pickle.dumps(share)
        got = self.ask("bundle", blob, how, samples)
        share.revoke()
        self._check(got, tree, samples, f"ordinary dict ({'laid out, ' if layout else ''}{how})")
        return {**got, "total": got["end"] - t0, "export": t1 - t0, "parts": share.allocations}

    def torch_ordinary(self, spec: list) -> dict:
        """torch.multiprocessing with an ordinary dict: the Queue's put moves every storage into shared
        memory (torch's reducer) on the way, as it does for any tensor not shared yet."""
        return self._torch_handover({k: torch.from_numpy(v) for k, v in ordinary_tree(spec, "numpy").items()})

    def torch(self, spec: list, arenas: bool) -> dict:
        return self._torch_handover(torch_tree(spec, arenas))

    def _torch_handover(self, tensors: dict) -> dict:
        """``tensors`` put on the torch.multiprocessing Queue, timed until the consumer has used them all."""
        count = len(tensors)
        t0 = time.monotonic()
        self.queue.put(tensors)
        got = self.tconn.recv()
        del tensors
        if got["count"] != count:
            raise SystemExit(f"torch.multiprocessing: the consumer received {got['count']} of {count} tensors")
        return {**got, "total": got["end"] - t0}

    def close(self) -> None:
        self.conn.send(None)
        self.gs_proc.join(30)
        if self.torch_proc is not None:
            self.queue.put(None)
            self.torch_proc.join(30)
        for proc in (self.gs_proc, self.torch_proc):
            if proc is not None and proc.is_alive():
                proc.kill()


def _family() -> list[int]:
    """This process and every process it started, at any depth (consumers, torch's shm manager, trackers)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    family = [os.getpid()]
    for pid in family:
        family += [child for child, parent in parents.items() if parent == pid]
    return family


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total


def settle(limit: float = 5.0) -> float:
    """Wait (up to ``limit`` s) until this process and its children used no CPU over 50 ms: what one
    hand-over left to do (freeing, torch's shm manager unlinking files) is not timed in the next.
    Returns the seconds waited."""
    gc.collect()  # in this process too: the export's clock starts on a collected heap
    t0 = time.monotonic()
    pids = _family()
    before = _cpu_ticks(pids)
    while time.monotonic() - t0 < limit:
        time.sleep(0.05)
        now = _cpu_ticks(pids)
        if now == before:
            break
        before = now
    return time.monotonic() - t0


def _fds_for_shares(count: int) -> str | None:
    """Why this process cannot hold ``count`` more exports of gs.empty memory (one fd each), or None."""
    need = len(os.listdir("/proc/self/fd")) + count + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return None
    if need > hard:
        return (f"skipped: {count} exports hold one fd each (the memfd), about {need} fds in all, above "
                f"RLIMIT_NOFILE's hard limit of {hard} here (raising it needs CAP_SYS_RESOURCE)")
    return None


# -- printing -----------------------------------------------------------------------------------


def _ms(values: list[float], digits: int = 1) -> str:
    return spread(values, digits, 8, scale=1e3, unit=" ms")


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "BELOW"


VARIANTS = [
    ("a-get", "(a) one bundle; open + bundle.get() (copies every byte)"),
    ("a-asarray", "(a) one bundle; open + np.asarray of every view (zero-copy)"),
    ("b", "(b) one share per tensor; open + np.asarray of each"),
    ("c", f"(c) torch.mp Queue, one storage per tensor ({TORCH_STRATEGY})"),
    ("c-arena", f"(c) torch.mp Queue, views of 64 MiB arenas ({TORCH_STRATEGY})"),
]


def ordinary_section(runner: Runner, cases: list[tuple[str, str, list]], runs: int) -> list[str]:
    """Ordinary state dicts, every tensor its own allocation, against torch.multiprocessing."""
    print(f"0. ordinary state dicts (every tensor an allocation of its own, as torch.ones, np.ones or a loaded "
          f"checkpoint give them), hand-over to usable tensors in a second process: median (lowest-highest) of "
          f"{runs} runs\n")
    targets = []
    for name, title, spec in cases:
        kind = "numpy" if name == "numpy" else "torch"
        variants = {"get": lambda: runner.ordinary(spec, kind, False, "get"),
                    "layout": lambda: runner.ordinary(spec, kind, True, "asarray")}
        if torch is not None:
            variants["torch-mp"] = lambda: runner.torch_ordinary(spec)
        rows: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(runs):
            for v, measure in variants.items():
                settle()
                rows[v].append(measure())
        total = sum(_nbytes(sh, d) for _, sh, d in spec)
        print(f"{title}: {len(spec):,} {'NumPy arrays' if kind == 'numpy' else 'torch CPU tensors'}, "
              f"{total / MiB:.1f} MiB")
        labels = {"get": "gs.export of the dict; open + bundle.get() (fresh arrays)",
                  "layout": "gs.share_memory + gs.export; open + np.asarray of every view",
                  "torch-mp": "torch.mp Queue of the dict (put moves each storage to shm)"}
        for v, r in rows.items():
            extra = ""
            if "open" in r[0]:
                extra = (f"  [{r[0]['parts']:,} allocations, export {_med(r, 'export') * 1e3:.1f}, open "
                         f"{_med(r, 'open') * 1e3:.1f}, use {_med(r, 'use') * 1e3:.1f} ms; {'+'.join(r[0]['paths'])}]")
            print(f"  {labels[v]:<64} {_ms([x['total'] for x in r])}{extra}")
        med = {v: _med(r, "total") for v, r in rows.items()}
        if "torch-mp" in med:
            print(f"  ratios (above 1: gpushare faster): torch.mp / gs.export of the dict "
                  f"{med['torch-mp'] / med['get']:.2f}x; torch.mp / share_memory+export "
                  f"{med['torch-mp'] / med['layout']:.2f}x\n")
            want = {"llama": 1.0, "small": 3.0}.get(name)
            if want is not None:
                ratio = med["torch-mp"] / med["get"]
                targets.append(f"{title}, ordinary, >= {want:g}x torch.multiprocessing: {ratio:.2f}x  "
                               f"{_verdict(ratio >= want)}")
            else:
                ratio = med["torch-mp"] / med["layout"]
                targets.append(f"{title} through gs.share_memory (its copy counted), >= 10x torch.multiprocessing: "
                               f"{ratio:.2f}x  {_verdict(ratio >= 10)}")
        else:
            print("  torch is not installed: no torch.multiprocessing reference\n")
        if name == "numpy":
            views = statistics.median(r["open"] + r["views"] for r in rows["layout"])
            arrays = statistics.median(r["open"] + r["use"] for r in rows["layout"])
            print(f"  gs.open + bundle.tree() (a view of every tensor) {views * 1e3:.1f} ms; + np.asarray of each "
                  f"{arrays * 1e3:.1f} ms (median)\n")
            targets.append(f"open to a view of every one of {len(spec):,} laid-out tensors (gs.open + bundle.tree()) "
                           f"<= 50 ms: {views * 1e3:.1f} ms  {_verdict(views <= 0.05)}")
    return targets


def handover_section(runner: Runner, workloads: list[tuple[str, list]], runs: int) -> dict:
    print(f"1. hand-over to usable arrays in a second process, host memory, one node: median (lowest-highest) "
          f"of {runs} runs\n")
    results = {}
    for title, spec in workloads:
        skip = {"c": "torch is not installed", "c-arena": "torch is not installed"} if torch is None else {}
        why = _fds_for_shares(len(spec))
        if why:
            skip["b"] = why
        rows: dict[str, list[dict]] = {name: [] for name, _ in VARIANTS if name not in skip}
        for _ in range(runs):  # the kinds interleaved: each sees the machine in the same states
            for name, measured in rows.items():
                settle()
                if name.startswith("a"):
                    measured.append(runner.bundle(spec, name[2:]))
                elif name == "b":
                    measured.append(runner.shares(spec))
                else:
                    measured.append(runner.torch(spec, name == "c-arena"))
        total = sum(_nbytes(s, d) for _, s, d in spec)
        a = rows["a-get"][0]
        print(f"{title}: {len(spec):,} tensors, {total / MiB:.1f} MiB, {a['parts']} allocations "
              f"({'gs.Arena chunks' if ALLOCATOR == 'arena' else 'gs.empty buffers'})")
        for name, label in VARIANTS:
            if name in skip:
                print(f"  {label:<62} {skip[name]}")
                continue
            r = rows[name]
            parts = ""
            if "export" in r[0]:
                parts = (f"  [export {_med(r, 'export') * 1e3:.1f}, pickle {_med(r, 'pickle') * 1e3:.1f}, unpickle "
                         f"{_med(r, 'unpickle') * 1e3:.1f}, open {_med(r, 'open') * 1e3:.1f}, "
                         f"{'get' if name == 'a-get' else 'asarray'} {_med(r, 'use') * 1e3:.1f} ms; "
                         f"{'+'.join(r[0]['paths'])}]")
            else:
                parts = f"  [numpy() of each {_med(r, 'use') * 1e3:.1f} ms]"
            print(f"  {label:<62} {_ms([x['total'] for x in r])}{parts}")
        ratios = []
        med = {name: _med(r, "total") for name, r in rows.items()}
        for other, base, what in (("c", "a-get", "torch one-storage / bundle+get"),
                                  ("c", "a-asarray", "torch one-storage / bundle+asarray"),
                                  ("c-arena", "a-asarray", "torch arenas / bundle+asarray"),
                                  ("b", "a-asarray", "per-tensor shares / bundle+asarray")):
            if other in med and base in med:
                ratios.append(f"{what} {med[other] / med[base]:.1f}x")
        print("  ratios of the medians (above 1: the bundle is faster): " + "; ".join(ratios) + "\n")
        results[title] = rows
    return results


def handover_targets(results: dict, big: str, count: int) -> list[str]:
    """The hand-over target: torch.multiprocessing (one storage per tensor, as a
    state dict's parameters are) against the faster of the bundle's two ways."""
    rows = results[big]
    if "c" not in rows:
        return [f"bundle hand-over of {count:,} tensors >= 20x faster than torch.multiprocessing: not measured "
                "(torch is not installed)"]
    best = min(("a-get", "a-asarray"), key=lambda name: _med(rows[name], "total"))
    ratio = _med(rows["c"], "total") / _med(rows[best], "total")
    how = "bundle.get()" if best == "a-get" else "np.asarray of every view"
    return [f"bundle hand-over of {count:,} tensors ({how}) >= 20x faster than torch.multiprocessing: "
            f"{ratio:.1f}x  {_verdict(ratio >= 20)}"]


def open_section(runner: Runner, results: dict, big: str, count: int, reps: int) -> list[str]:
    rows = results[big]["a-get"] + results[big]["a-asarray"]
    opens = [r["open"] for r in rows]
    print("2. opening in the consumer (median, lowest-highest)\n")
    print(f"  gs.open of the bundle of {count:,} tensors ({len(opens)} opens)      {_ms(opens, 2)}")
    buf = gs.empty(1024, "float32")
    buf[:] = 1.0
    share = gs.export(buf, lifetime="revoked")
    try:
        single = runner.ask("single", pickle.dumps(share), reps)
    finally:
        share.revoke()
    asking = gs.export(buf)  # "auto": a close can end it, so every open asks the exporter
    asked = runner.ask("single", pickle.dumps(asking), reps)
    del asking
    shm = shared_memory.SharedMemory(create=True, size=buf.nbytes)
    try:
        floor = runner.ask("shm", shm.name, buf.nbytes, reps)["usable"]
    finally:
        shm.close()
        shm.unlink()
    print(f"  further gs.open of one 4 KiB share ({single['path']}, {reps} opens)      {_ms(single['open'], 3)}")
    print(f"  ... + np.asarray of it (usable)                          {_ms(single['usable'], 3)}")
    print("    (lifetime='revoked': each reopens the closed view's kept lease and mapping, no message)")
    print(f"  the same, lifetime='auto' (each open asks the exporter)  {_ms(asked['open'], 3)}")
    print(f"  shared_memory.SharedMemory(name) + np.ndarray (floor)    {_ms(floor, 3)}\n")
    bundle_open, one_open = statistics.median(opens), statistics.median(single["open"])
    first = f"gs.open of a {count:,}-tensor bundle <= 50 ms: {bundle_open * 1e3:.2f} ms  {_verdict(bundle_open <= 0.05)}"
    further = (f"further gs.open of one share on one node <= 0.2 ms: {one_open * 1e3:.3f} ms  "
               f"{_verdict(one_open <= 0.0002)} (shared_memory attach: {statistics.median(floor) * 1e3:.3f} ms)")
    return [first, further]


def size_section(results: dict, workloads: list[tuple[str, list]], big: str, count: int) -> list[str]:
    print("3. the pickled bundle share\n")
    per = {}
    for title, spec in workloads:
        r = results[title]["a-get"][0]
        per[title] = r["bytes"] / len(spec)
        keys = sum(len(k) for k, _, _ in spec) / len(spec)
        print(f"  {title:<52} {r['bytes']:>9,} bytes, {per[title]:6.1f} per tensor (keys {keys:.0f} characters)")
    keys = [secrets.token_hex(6) for _ in range(count)]
    tree, _ = gs_tree([(k, (64,), "float32") for k in keys])
    share = gs.export(tree, lifetime="revoked")
    n = len(pickle.dumps(share))
    share.revoke()
    print(f"  {'(the same with random 12-hex-digit keys)':<52} {n:>9,} bytes, {n / count:6.1f} per tensor\n")
    return [f"pickled share of {count:,} tensors <= 64 bytes per tensor: {per[big]:.1f}  {_verdict(per[big] <= 64)}"]


# -- across two network namespaces --------------------------------------------------------------


def node_export(workload: str) -> None:
    """In the exporting namespace: the bundle and one share of one buffer of the same bytes."""
    tree, _ = gs_tree(spec_named(workload))
    total = sum(v.nbytes for v in tree.values())
    whole = gs.empty(total, "uint8")
    whole[:] = _pattern(total)
    bundle, single = gs.export(tree, lifetime="revoked"), gs.export(whole, lifetime="revoked")
    samples = _samples(list(tree))
    print(json.dumps({"bundle": pickle.dumps(bundle).hex(), "single": pickle.dumps(single).hex(),
                      "digests": _digests(tree, samples), "whole": _digests({"w": whole}, ["w"])["w"]}), flush=True)
    sys.stdin.readline()  # the importer is done


def _per_call(fn: Any, budget: float) -> float:
    """Median seconds of ``fn()`` over calls for about ``budget`` seconds (at least 3)."""
    times: list[float] = []
    end = time.perf_counter() + budget
    while len(times) < 3 or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def node_import(runs: int, budget: float, profile: bool) -> None:
    """In the importing namespace: open both over ucx-rma, time the gets."""
    warnings.simplefilter("ignore", gs.SlowPathWarning)
    hello = json.loads(sys.stdin.readline())
    share = pickle.loads(bytes.fromhex(hello["bundle"]))
    t0 = time.perf_counter()
    bundle = gs.open(share)
    first_open = time.perf_counter() - t0
    view = gs.open(pickle.loads(bytes.fromhex(hello["single"])))
    got = bundle.get()
    out = np.empty(view.nbytes, np.uint8)
    view.get(out)
    if _digests(got, sorted(hello["digests"])) != hello["digests"] or _digests({"w": out}, ["w"])["w"] != hello["whole"]:
        raise SystemExit("across namespaces: the bytes read are not the exporter's")
    dests = {k: np.empty_like(v) for k, v in got.items()}
    layout = [(k, v.nbytes, v.dtype, v.shape) for k, v in got.items()]

    def floor() -> dict:  # the bytes in one get, then one NumPy array per tensor over them
        whole = np.empty(view.nbytes, np.uint8)
        view.get(whole)
        arrays, at = {}, 0
        for k, n, dtype, shape in layout:
            arrays[k] = whole[at:at + n].view(dtype).reshape(shape)
            at += n
        return arrays

    result: dict[str, Any] = {"paths": sorted(set(bundle.paths) | {view.path}), "nbytes": view.nbytes,
                              "first_open": first_open, "get": [], "get_dests": [], "single": [], "floor": [],
                              "open": []}
    for _ in range(runs):
        result["get"].append(_per_call(bundle.get, budget))
        result["get_dests"].append(_per_call(lambda: bundle.get(dests), budget))
        result["single"].append(_per_call(lambda: view.get(out), budget))
        result["floor"].append(_per_call(floor, budget))
        t0 = time.perf_counter()
        gs.open(share).close()
        result["open"].append(time.perf_counter() - t0)
    if profile:
        listings = []
        for what, fn in (("bundle.get()", bundle.get), ("bundle.get(dests)", lambda: bundle.get(dests))):
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            listings.append(_top(prof, f"{what} of {len(got):,} tensors over ucx-rma (importer)", sort="cumulative"))
        result["profile"] = "\n\n".join(listings)
    bundle.close()
    view.close()
    print(json.dumps(result), flush=True)


def _node(nodes: Any, who: str, ns: str, *args: str, env: dict | None = None) -> _Program:
    log = tempfile.TemporaryFile()  # noqa: SIM115 - _Program.end closes it
    try:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--node",
                                 *args], env={**nodes.env, **(env or {})}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True)
    except BaseException:
        log.close()
        raise
    return _Program(who, proc, log)


def _netns_pair(nodes: Any, workload: str, runs: int, budget: float, profile: bool) -> dict:
    """One exporter and one importer of ``workload`` across the namespaces: what the importer measured."""
    deadline = time.monotonic() + NODE_TIMEOUT
    # The exporter's listeners (control channel, UCX) on its veth address only.
    exporter = _node(nodes, "exporter", nodes.producer_ns, "export", workload, ALLOCATOR,
                     env={"GPUSHARE_CONTROL_HOST": nodes.producer_ip})
    importer = None
    try:
        if not select.select([exporter.proc.stdout], [], [], NODE_TIMEOUT)[0]:
            raise SystemExit(f"the exporter printed nothing within {NODE_TIMEOUT} s:\n{exporter.stderr()}")
        hello = exporter.proc.stdout.readline()
        if not hello:
            exporter.proc.wait(30)
            raise SystemExit(f"the exporter exited with {exporter.proc.returncode}:\n{exporter.stderr()}")
        importer = _node(nodes, "importer", nodes.consumer_ns, "import", str(runs), str(budget), str(int(profile)))
        importer.proc.stdin.write(hello)
        importer.proc.stdin.flush()
        got = importer.result(deadline)
        exporter.proc.stdin.write("done\n")
        exporter.proc.stdin.flush()
        exporter.proc.wait(30)
    finally:
        for program in (exporter, importer):
            if program is not None:
                program.end()
    if got["paths"] != ["ucx-rma"]:
        raise SystemExit(f"across namespaces the shares were opened over {got['paths']}, not ucx-rma")
    return got


def netns_section(workloads: list[str], runs: int, budget: float, profile: bool) -> list[str]:
    print("4. across two network namespaces, over ucx-rma: bundle.get() against one get of the same bytes "
          f"(median, lowest-highest, of {runs} runs, each the median of the calls made in {budget} s)\n")
    why = _netns_unavailable()
    if why is not None:
        print(f"  skipped: {why}\n")
        return [f"bundle.get() / one contiguous get across nodes >= 0.5: skipped ({why})"]
    ratio = 0.0
    with _two_nodes() as nodes:
        print(f"  exporter in {nodes.producer_ns} ({nodes.producer_ip}), importer in {nodes.consumer_ns} "
              f"({nodes.consumer_ip}), one veth pair; every allocation opened over ucx-rma\n")
        for workload in workloads:
            target = workload == workloads[-1]
            got = _netns_pair(nodes, workload, runs, budget, profile and target)
            n = got["nbytes"]
            print(f"  {title_of(workload)}: {len(spec_named(workload)):,} tensors, {n / MiB:.2f} MiB")
            print(f"    first gs.open of the bundle (connects)                 {got['first_open'] * 1e3:8.1f} ms")
            print(f"    further gs.open of the bundle                          {_ms(got['open'], 2)}")
            bw = {k: [n / t / MiB for t in got[k]] for k in ("get", "get_dests", "single", "floor")}
            print(f"    bundle.get() (fresh arrays)                            {spread(bw['get'], 0, 8, unit=' MiB/s')}")
            print(f"    bundle.get(dests) (into arrays of its own)             "
                  f"{spread(bw['get_dests'], 0, 8, unit=' MiB/s')}")
            print(f"    one share of one buffer, view.get(out)                 {spread(bw['single'], 0, 8, unit=' MiB/s')}")
            print(f"    ... + one NumPy array per tensor over its bytes        {spread(bw['floor'], 0, 8, unit=' MiB/s')}"
                  "  (arrays made one at a time)")
            ratio = statistics.median(bw["get"]) / statistics.median(bw["single"])
            ratio_d = statistics.median(bw["get_dests"]) / statistics.median(bw["single"])
            print(f"    ratio to the contiguous get: bundle.get() {ratio:.2f}, bundle.get(dests) {ratio_d:.2f}\n")
            if "profile" in got:
                print(got["profile"] + "\n")
    count = len(spec_named(workloads[-1]))
    return [(f"bundle.get() / one contiguous get of {count:,} tensors across nodes >= 0.5: {ratio:.2f}  "
             f"{_verdict(ratio >= 0.5)}")]


# -- main ----------------------------------------------------------------------------------------


def profile_section(runner: Runner, spec: list) -> None:
    tree, _ = gs_tree(spec)
    prof = cProfile.Profile()
    prof.enable()
    share = gs.export(tree, lifetime="revoked")
    prof.disable()
    print(_top(prof, f"gs.export of {len(spec):,} tensors (exporter)") + "\n")
    buf = gs.empty(1024, "float32")
    single = gs.export(buf, lifetime="revoked")
    print(runner.ask("profile", pickle.dumps(share), pickle.dumps(single), 200) + "\n")
    share.revoke()
    single.revoke()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None, help="runs of every figure (median, lowest-highest); default 5")
    p.add_argument("--quick", action="store_true", help="smaller sizes, one run")
    p.add_argument("--profile", action="store_true", help="cProfile listings of the largest bundle's hand-over")
    p.add_argument("--no-netns", dest="netns", action="store_false", help="leave out the two-namespace section")
    p.add_argument("--netns-only", action="store_true", help="only the two-namespace section")
    p.add_argument("--ordinary-only", action="store_true", help="only section 0, the ordinary state dicts")
    p.add_argument("--carved-only", action="store_true", help="leave section 0 (ordinary state dicts) out")
    p.add_argument("--allocator", choices=("views", "arena"), default="views",
                   help="gpushare's tensors: slices of gs.empty buffers (default) or gs.Arena.empty arrays")
    args = p.parse_args()
    global ALLOCATOR
    ALLOCATOR = args.allocator
    runs = args.runs or (1 if args.quick else 5)
    if args.quick:
        names, reps, budget = ["llama:16:16", "flat:200", "flat:2000"], 50, 0.1
        ordinary = [("llama", "llama:16:4"), ("small", "flat:500"), ("numpy", "flat:2000")]
    else:
        names, reps, budget = ["llama:8:4", "flat:1000", "flat:20000"], 500, 0.3
        ordinary = [("llama", "llama:16:1"), ("small", "flat:5000"), ("numpy", "flat:20000")]
    workloads = [(title_of(name), spec_named(name)) for name in names]
    big, count = workloads[-1][0], len(workloads[-1][1])
    strategy = f"torch {torch.__version__}, sharing strategy {TORCH_STRATEGY}" if torch is not None else "no torch"
    made = "gs.Arena(chunk_size=64 MiB).empty" if ALLOCATOR == "arena" else "slices of 64 MiB gs.empty buffers"
    print(f"gpushare {gs.__version__}, {os.cpu_count()} CPUs, {strategy}; gpushare's tensors: {made}; times: "
          f"CLOCK_MONOTONIC in both processes; every figure the median of {runs} runs (lowest-highest)\n")
    targets: list[str] = []
    if args.netns_only:
        targets += netns_section([names[0], names[-1]], runs, budget, args.profile)
        print("targets")
        for line in targets:
            print("  " + line)
        return 0
    runner = Runner()
    try:
        warm = flat_spec(8)  # imports, connection, first-use costs: out of the runs
        runner.bundle(warm, "get"), runner.bundle(warm, "asarray"), runner.shares(warm)
        if torch is not None:
            runner.torch(warm, False), runner.torch(warm, True)
        if not args.carved_only:
            cases = [(kind, title_of(spec), spec_named(spec)) for kind, spec in ordinary]
            targets += ordinary_section(runner, cases, runs)
            if args.ordinary_only:
                return _report_targets(targets, args.quick)
        results = handover_section(runner, workloads, runs)
        targets += handover_targets(results, big, count)
        targets += open_section(runner, results, big, count, reps)
        targets += size_section(results, workloads, big, count)
        if args.profile:
            profile_section(runner, flat_spec(count))
    finally:
        runner.close()
    if args.netns:
        targets += netns_section([names[0], names[-1]], runs, budget, args.profile)
    return _report_targets(targets, args.quick)


def _report_targets(targets: list[str], quick: bool) -> int:
    print("targets" + (" (stated for 20,000 tensors; --quick measured fewer)" if quick else ""))
    for line in targets:
        print("  " + line)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--node":
        role = sys.argv[2]
        if role == "export":
            ALLOCATOR = sys.argv[4]
            node_export(sys.argv[3])
        else:
            node_import(int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1")
        sys.exit(0)
    sys.exit(main())
