"""Example: trace one training iteration of a small GPT (AdamW) with gpucast.

Trains the zoo's gpt model (examples/zoo.py) on the CPU for --steps iterations, traces iteration 2
with gpucast.trace() and prints the trace's summary. Run with --help for the options.
"""
import sys
from pathlib import Path

# The repository root, so that examples.zoo imports when this file is run as a script.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from examples import zoo  # noqa: E402

if __name__ == "__main__":
    sys.exit(zoo.run_example("gpt", sys.argv[1:]))
