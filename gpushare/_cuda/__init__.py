"""The CUDA engine: the driver (:mod:`._driver`), CUDA virtual memory
(:mod:`.vmm`) and what the node's NVLink fabric allows (:mod:`.fabric`).

Below the paths: the paths and the UCX engine use it, it uses neither.
Importing it loads nothing of CUDA; ``cuda.bindings`` and ``cuda.core`` are
loaded the first time a function needs them.
"""
