"""Run the documentation: every Python block of README.md and docs/*.md, with Sybil.

Each ``python`` block is a complete program and runs as one, in a fresh
interpreter (so blocks that start a second process with ``multiprocessing``
work as written), from a scratch directory; it passes when it exits with
status 0.  Blocks that need hardware are preceded by a Sybil skip directive,
``<!-- skip: next needs_cuda("what for") -->``, and are skipped, saying why,
where no CUDA device is usable.  Shell blocks are not run.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent
TIMEOUT = 180


def run_block(example: Example) -> None:
    """Run one block as a script; fail with its output when it does not exit 0."""
    with tempfile.TemporaryDirectory(prefix="gpushare-doc-") as scratch:
        script = Path(scratch) / "block.py"
        script.write_text(example.parsed)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        try:
            r = subprocess.run([sys.executable, str(script)], cwd=scratch, env=env, capture_output=True, text=True,
                               timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{example.path}:{example.line}: the block ran past {TIMEOUT} s\n"
                                 f"{exc.stdout or ''}{exc.stderr or ''}") from None
    if r.returncode != 0:
        raise AssertionError(f"{example.path}:{example.line}: the block exited with status {r.returncode}\n"
                             f"--- stdout\n{r.stdout}--- stderr\n{r.stderr}")


def _setup(namespace: dict) -> None:
    def needs_cuda(what: str) -> str | None:
        # tests/conftest.py holds the suite's own probe (never faked)
        spec = importlib.util.spec_from_file_location("_gpushare_tests_conftest", ROOT / "tests" / "conftest.py")
        probe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(probe)
        reason = probe.cuda_device_reason()
        return None if reason is None else f"{what} needs a CUDA device: {reason}"

    namespace["needs_cuda"] = needs_cuda


pytest_collect_file = Sybil(
    parsers=[CodeBlockParser(language="python", evaluator=run_block), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    path=str(ROOT),
    setup=_setup,
).pytest()
