"""Weight sync between two Ray actors: gpushare's tensor transport against
Ray's object store and Ray's GLOO transport, in one run.

A trainer actor holds a model-shaped state dict of float32 torch tensors
(the embedding, then attention, MLP and norm weights per layer, as in
``examples/ray_weight_sync.py``); each step the driver asks it for the
weights and hands the ObjectRef to an inference actor, which receives them
and reads one element of every tensor.  The time is the hand-over, from the
driver's ``trainer.state_dict.remote()`` to the inference actor's reply:
what a weight-sync loop waits for each step, Ray's task overhead included.
Median of ``--reps`` steps after two warm-up steps, with the spread
(min-max), for each way:

* ``object store``: the method without a tensor transport: Ray serializes
  the dict into its object store and the inference actor reads it from there
  (plain ``ray.get`` semantics);
* ``gloo``: ``tensor_transport="gloo"`` over a collective group of the two
  actors (Ray's CPU transport; two-sided: both actors run the transfer);
* ``gpushare cma``: ``tensor_transport="gpushare"``, the weights in torch's
  own allocations (one per tensor): the exporter copies with the kernel's
  cross-memory attach;
* ``gpushare host-fd``: the same weights laid out in one ``gs.empty``
  buffer: the receiver maps it and copies;
* ``gpushare host-fd zero-copy``: ``register(zero_copy=True)``: the
  receiver maps it and copies nothing (its tensors are the trainer's memory).

Ratios are the object store's time (and gloo's) over gpushare's: above 1,
gpushare is faster.  Every way is checked: the inference actor compares one
element of each tensor with what the trainer wrote for that step.

Run: ``python benchmarks/bench_ray.py [--reps N] [--sizes small,large]``
(``small``: 4 layers of hidden size 64, about 0.9 MiB in 29 tensors;
``large``: 5 layers of hidden size 512, about 61 MiB in 36 tensors).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import ray
import torch  # before gpushare may load UCX (docs/ucx.md)
from ray.experimental.collective import create_collective_group, destroy_all_collective_groups

import gpushare.ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import ray_weight_sync  # the example's model layout, sent to the actors by value
from _report import spread

SIZES = {"small": (4, 64), "large": (5, 512)}


def make_actors():
    @ray.remote(enable_tensor_transport=True, num_cpus=0)  # type: ignore[call-overload]  # Ray's overloads omit it
    class Trainer:
        def __init__(self, names: dict[str, tuple[int, ...]]) -> None:
            self.plain = ray_weight_sync.layout(names, plain=True)
            self.pooled = ray_weight_sync.layout(names, plain=False)
            self.version = 0

        def step(self) -> int:
            self.version += 1
            for weights in (self.plain, self.pooled):
                for i, w in enumerate(weights.values()):
                    w.fill_(self.version * 1000 + i)
            return self.version

        def state_dict(self, pooled: bool) -> dict[str, torch.Tensor]:
            return self.pooled if pooled else self.plain

    @ray.remote(enable_tensor_transport=True, num_cpus=0)  # type: ignore[call-overload]  # Ray's overloads omit it
    class Inference:
        def load(self, weights: dict[str, torch.Tensor], version: int) -> int:
            """Read one element of each tensor; return how many are wrong."""
            return sum(1 for i, w in enumerate(weights.values()) if float(w.view(-1)[-1]) != version * 1000 + i)

        def paths(self) -> dict:
            return gpushare.ray.stats()["paths"]

    return Trainer, Inference


WAYS = [  # (label, tensor transport or None, pooled weights)
    ("object store", None, False),
    ("gloo", "gloo", False),
    ("gpushare cma", "gpushare", False),
    ("gpushare host-fd", "gpushare", True),
    ("gpushare host-fd zero-copy", "gpushare_zc", True),
]


def hand_over(trainer, inference, transport: str | None, pooled: bool, reps: int) -> list[float]:
    method = trainer.state_dict if transport is None else trainer.state_dict.options(tensor_transport=transport)
    times = []
    for rep in range(reps + 2):  # two warm-up steps
        version = ray.get(trainer.step.remote())
        start = time.perf_counter()
        ref = method.remote(pooled)
        wrong = ray.get(inference.load.remote(ref, version), timeout=300)
        took = time.perf_counter() - start
        del ref
        if wrong:
            raise AssertionError(f"{wrong} tensors arrived wrong ({transport or 'object store'})")
        if rep >= 2:
            times.append(took)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sizes", default="small,large", help="comma-separated: " + ", ".join(SIZES))
    args = parser.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {sorted(SIZES)}")

    gpushare.ray.register()
    gpushare.ray.register("gpushare_zc", zero_copy=True)
    Trainer, Inference = make_actors()
    ray.cloudpickle.register_pickle_by_value(ray_weight_sync)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        print(f"Ray {ray.__version__}, torch {torch.__version__}; hand-over of a state dict from a trainer actor "
              f"to an inference actor, median (min-max) of {args.reps} steps")
        for size in sizes:
            names = ray_weight_sync.shapes(*SIZES[size])
            nbytes = sum(torch.Size(s).numel() for s in names.values()) * 4
            trainer, inference = Trainer.remote(names), Inference.remote()
            ray.get(trainer.step.remote())
            gloo_reason = None
            try:
                create_collective_group([trainer, inference], backend="torch_gloo")
            except Exception as exc:  # noqa: BLE001 - the row says why it is missing
                gloo_reason = f"{type(exc).__name__}: {exc}"
            print(f"\n{size}: {len(names)} tensors, {nbytes / (1 << 20):.1f} MiB")
            results: dict[str, list[float]] = {}
            for label, transport, pooled in WAYS:
                if transport == "gloo" and gloo_reason:
                    print(f"  {label:28s} skipped: {gloo_reason}")
                    continue
                results[label] = hand_over(trainer, inference, transport, pooled, args.reps)
                mid = statistics.median(results[label])
                print(f"  {label:28s} {spread(results[label], scale=1e3, unit=' ms')}  "
                      f"{nbytes / mid / 1e9:6.2f} GB/s", flush=True)
            paths = ray.get(inference.paths.remote())
            print(f"  gpushare tensors received per path: {paths}")
            for label in [w[0] for w in WAYS if w[0].startswith("gpushare")]:
                ours = statistics.median(results[label])
                print("  " + ", ".join(f"{other} / {label}: {statistics.median(results[other]) / ours:.2f}"
                                       for other in ("object store", "gloo") if other in results))
            destroy_all_collective_groups()
            ray.kill(trainer)
            ray.kill(inference)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
