"""Weight sync between a trainer and an inference process, as in RL post-training.

The trainer lays its model's weights out in one gpushare buffer (as an
allocator would: every tensor a view of it), exports the whole state dict
once as a bundle, and updates the weights in place each step.  The inference
process opens the bundle once and, each step, reads the new version: no new
export, no new open, one lease for every tensor.

The update is signalled through the bundle itself, with a documented
version counter (a seqlock): the trainer sets ``version`` odd while it
writes and even (``2 * step``) once the step's weights are complete; the
reader copies the weights when the version is even and new, and keeps the
copy only if the version did not move meanwhile.  Here the inference process
also writes ``ack`` (its own tensor in the bundle) after each version it
read, and the trainer waits for it, so every step is read exactly once; a
real inference engine would skip to the newest version instead.  At the
end the inference process prints how long reading one version took (the
median over the versions, timed around the batch read alone) and its rate
in GB/s.

Run: python examples/weight_sync.py [--steps N] [--layers N] [--hidden N] [--cuda]

``--cuda`` keeps the weights in CUDA memory (needs CuPy and a GPU); the
counters stay in host memory either way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import numpy as np

import gpushare as gs

def shapes(layers: int, hidden: int, vocab: int = 512) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a small Llama-style decoder (intermediate size 4 * hidden)."""
    out: dict[str, tuple[int, ...]] = {"embed": (vocab, hidden)}
    for i in range(layers):
        for name, shape in (("q", (hidden, hidden)), ("k", (hidden, hidden)), ("v", (hidden, hidden)),
                            ("o", (hidden, hidden)), ("up", (4 * hidden, hidden)), ("down", (hidden, 4 * hidden)),
                            ("norm", (hidden,))):
            out[f"layers.{i}.{name}"] = shape
    return out


def expected(name_index: int, shape: tuple[int, ...], step: int) -> np.ndarray:
    """What weight number ``name_index`` holds after ``step`` steps."""
    return np.full(shape, name_index + step * 0.5, dtype=np.float32)


def layout(names: dict[str, tuple[int, ...]], device: Any) -> dict[str, Any]:
    """Every weight a view of one gpushare buffer (one allocation: one offer)."""
    total = sum(int(np.prod(s)) for s in names.values())
    if device == "host":
        pool: Any = gs.empty(total, "float32")
    else:
        import cupy

        pool = cupy.asarray(gs.empty(total, "float32", device=device))
    weights, at = {}, 0
    for name, shape in names.items():
        n = int(np.prod(shape))
        weights[name] = pool[at:at + n].reshape(shape)
        at += n
    return weights


def trainer(steps: int, layers: int, hidden: int, device: Any, shares: Any, done: Any) -> None:
    names = shapes(layers, hidden)
    weights = layout(names, device)
    counters = gs.zeros(2, "int64")  # [version, ack], host memory
    for i, w in enumerate(weights.values()):
        w[...] = i
    share = gs.export({"weights": weights, "version": counters[:1], "ack": counters[1:]})
    shares.put(share)
    for step in range(1, steps + 1):
        counters[0] = 2 * step - 1  # odd: the weights are being written
        for w in weights.values():
            w += 0.5  # the training step, in place
        if device != "host":
            import cupy

            cupy.cuda.Device(device).synchronize()  # the step's writes are done before the version says so
        counters[0] = 2 * step  # even: version ``step`` is complete
        deadline = time.monotonic() + 60
        while counters[1] != step:  # the reader took this version
            if time.monotonic() > deadline:
                raise TimeoutError(f"the inference process did not read version {step}")
            time.sleep(0.0002)
    print(f"trainer: {steps} steps of {len(weights)} tensors ({sum(w.size for w in weights.values()) * 4} bytes) "
          f"on {device}, exported once", flush=True)
    done.get(timeout=120)


def inference(steps: int, shares: Any, done: Any) -> None:
    share = shares.get(timeout=60)
    seen, wrong, retries = 0, 0, 0
    took, nbytes = [], 0  # seconds of each kept read; bytes of one version
    with gs.open(share) as bundle:  # opened once, for every step
        version, ack = bundle["version"], bundle["ack"]
        v, a = np.asarray(version), np.asarray(ack)  # the counters, mapped
        weights = bundle["weights"]
        names = weights.keys()
        print(f"inference: opened {bundle.count} tensors in {len(bundle.paths)} allocations over "
              f"{', '.join(sorted(set(bundle.paths)))}", flush=True)
        last = 0
        while last < steps:
            now = int(v[0])
            if now % 2 or now // 2 <= last:
                time.sleep(0.0002)
                continue
            t0 = time.perf_counter()
            got = weights.get()  # every weight of this version, one batch
            t1 = time.perf_counter()
            if int(v[0]) != now:  # the trainer moved on while we copied: read again
                retries += 1
                continue
            took.append(t1 - t0)
            nbytes = sum(got[name].nbytes for name in names)
            last = now // 2
            for i, name in enumerate(names):
                host = got[name] if isinstance(got[name], np.ndarray) else _to_host(got[name])
                if not np.array_equal(host, expected(i, host.shape, last)):
                    wrong += 1
            seen += 1
            a[0] = last  # tell the trainer (a store into the mapped counter)
    print(f"inference: {seen} versions read, {wrong} wrong tensors, {retries} retries, no new export or open",
          flush=True)
    if took:
        mid = statistics.median(took)
        print(f"inference: an update of {nbytes} bytes read in {mid * 1e3:.3f} ms (median of {len(took)}, "
              f"{min(took) * 1e3:.3f}-{max(took) * 1e3:.3f}): {nbytes / mid / 1e9:.2f} GB/s", flush=True)
    done.put(True)
    if seen != steps or wrong:
        print("example failed", flush=True)
        sys.exit(1)


def _to_host(array: Any) -> np.ndarray:
    import cupy

    return cupy.asnumpy(cupy.asarray(array))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--cuda", action="store_true", help="weights in CUDA memory of device 0 (needs CuPy)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    shares, done = ctx.Queue(), ctx.Queue()
    device: Any = 0 if args.cuda else "host"
    reader = ctx.Process(target=inference, args=(args.steps, shares, done))
    reader.start()
    trainer(args.steps, args.layers, args.hidden, device, shares, done)
    reader.join(60)
    if reader.exitcode != 0:
        print("example failed", flush=True)
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
