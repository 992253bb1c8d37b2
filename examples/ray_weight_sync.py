"""Weight sync between two Ray actors through the gpushare tensor transport.

A trainer actor updates its model's weights in place each step and returns
them from a method marked ``@ray.method(tensor_transport="gpushare")``; an
inference actor is handed the ObjectRef and receives the weights: the
tensors travel through gpushare (one bundle for the whole state dict, one
open, one batch of copies), not through Ray's object store, and only the
small metadata goes through Ray.  When the driver drops the ref, Ray frees
the object and the trainer revokes its share.

By default the trainer lays its weights out in one gpushare buffer (every
tensor a view of it), so the inference actor copies them over host-fd (the
memory mapped, copied at memory speed); ``--plain`` keeps them in torch's
own allocations, which go over cma (the kernel's cross-memory attach);
``--zero-copy`` registers the transport with ``zero_copy=True``: the
inference actor then maps gpushare memory instead of copying it, and sees
the trainer's later writes (docs/ray.md).

The trainer steps only once the inference actor has received the step's
weights: a received copy holds the values of the moment it was made, and the
trainer must not write them while a receiver still copies (Ray's RDT
objects are the source's tensors themselves, not snapshots).

Run: python examples/ray_weight_sync.py [--steps N] [--layers N] [--hidden N] [--plain] [--zero-copy]
"""

from __future__ import annotations

import argparse
import sys
import time

import ray
import torch  # before gpushare may load UCX (docs/ucx.md)

import gpushare as gs
import gpushare.ray


def shapes(layers: int, hidden: int, vocab: int = 512) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a small Llama-style decoder: the embedding, then per layer
    attention, MLP (intermediate size 4 * hidden) and norm weights."""
    layer = {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden), "o": (hidden, hidden),
             "up": (4 * hidden, hidden), "down": (hidden, 4 * hidden), "norm": (hidden,)}
    return {"embed": (vocab, hidden)} | {f"layers.{i}.{name}": shape for i in range(layers)
                                         for name, shape in layer.items()}


def layout(names: dict[str, tuple[int, ...]], plain: bool) -> dict[str, torch.Tensor]:
    """float32 weights of these shapes: each in an allocation of torch's own
    (``plain``), else every one a view of one gpushare buffer."""
    if plain:
        return {name: torch.empty(shape) for name, shape in names.items()}
    pool = torch.from_dlpack(gs.empty(sum(torch.Size(s).numel() for s in names.values()), "float32"))
    weights, at = {}, 0
    for name, shape in names.items():
        n = torch.Size(shape).numel()
        weights[name] = pool[at:at + n].view(shape)
        at += n
    return weights


def expected(index: int, step: int) -> float:
    """The value every element of weight number ``index`` holds after ``step`` steps."""
    return index + step * 0.5


def make_actors(transport: str):
    """The two actors; made once the transport is registered (``@ray.method`` checks its name)."""

    @ray.remote(enable_tensor_transport=True, num_cpus=0)  # type: ignore[call-overload]  # Ray's overloads omit it
    class Trainer:
        def __init__(self, layers: int, hidden: int, plain: bool) -> None:
            self.weights = layout(shapes(layers, hidden), plain)
            for i, w in enumerate(self.weights.values()):
                w.fill_(expected(i, 0))

        def step(self) -> None:
            with torch.no_grad():
                for w in self.weights.values():
                    w += 0.5  # the training step, in place

        @ray.method(tensor_transport=transport)
        def state_dict(self) -> dict[str, torch.Tensor]:
            return self.weights

        def summary(self) -> tuple[int, int, dict]:
            return len(self.weights), sum(w.numel() * w.element_size() for w in self.weights.values()), \
                gpushare.ray.stats()

    @ray.remote(enable_tensor_transport=True, num_cpus=0)  # type: ignore[call-overload]  # Ray's overloads omit it
    class Inference:
        def __init__(self) -> None:
            self.weights: dict[str, torch.Tensor] = {}

        def load(self, weights: dict[str, torch.Tensor], step: int) -> int:
            """Take this step's weights (they arrived through gpushare); return how many are wrong."""
            self.weights = weights
            return sum(1 for i, w in enumerate(weights.values())
                       if not torch.equal(w, torch.full_like(w, expected(i, step))))

        def summary(self) -> dict:
            return gpushare.ray.stats()

    return Trainer, Inference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--plain", action="store_true", help="weights in torch's own allocations (cma)")
    parser.add_argument("--zero-copy", action="store_true", help="map gpushare memory instead of copying it")
    args = parser.parse_args()

    transport = gpushare.ray.register(zero_copy=args.zero_copy)  # a fresh key for this job, before the actors
    Trainer, Inference = make_actors(transport)
    # Every worker registers the transport at its start, so a ray.put in an actor finds it (docs/ray.md).
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=gpushare.ray.runtime_env())
    try:
        trainer = Trainer.remote(args.layers, args.hidden, args.plain)
        inference = Inference.remote()
        wrong, took = 0, []
        for step in range(1, args.steps + 1):
            ray.get(trainer.step.remote())
            start = time.perf_counter()
            ref = trainer.state_dict.remote()  # the tensors stay in the trainer; Ray carries the share
            wrong += ray.get(inference.load.remote(ref, step), timeout=120)
            took.append(time.perf_counter() - start)
            del ref  # Ray frees the object: the trainer revokes its share
        count, nbytes, trained = ray.get(trainer.summary.remote())
        deadline = time.monotonic() + 30
        while trained["revoked"] < args.steps and time.monotonic() < deadline:
            time.sleep(0.05)
            count, nbytes, trained = ray.get(trainer.summary.remote())
        received = ray.get(inference.summary.remote())
    finally:
        ray.shutdown()
    took.sort()
    print(f"trainer: {args.steps} steps of {count} tensors ({nbytes} bytes), exported {trained['exported']} "
          f"times as one bundle each, revoked {trained['revoked']}, {trained['live']} left", flush=True)
    paths = ", ".join(f"{p} {n}" for p, n in sorted(received["paths"].items()))
    print(f"inference: {received['received']} versions received ({paths} tensors; {received['copied']} copied, "
          f"{received['zero_copy']} zero-copy), {wrong} wrong tensors", flush=True)
    print(f"hand-over per step (ObjectRef to weights in the inference actor): median "
          f"{took[len(took) // 2] * 1e3:.2f} ms", flush=True)
    if wrong or received["received"] != args.steps or trained["revoked"] != args.steps:
        print("example failed", flush=True)
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
