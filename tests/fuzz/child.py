"""The fuzz runner's child: imports gpucast once, then evaluates inputs one after another.

    child.py PROGRESS_FILE RESULT_FD

Reads "index<TAB>target<TAB>path" lines on stdin; for each, first writes the index to PROGRESS_FILE (so that the
parent knows which input a crash or hang belongs to), then evaluates it and writes one JSON line
{"index", "outcome", "detail"} to RESULT_FD. "ready" on RESULT_FD once gpucast is imported. The child's own stdout
and stderr (gpucast's prints, a sanitizer's report) go wherever the parent sent them.
"""
import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# A runaway allocation fails as std::bad_alloc / MemoryError (a fault with a message) rather than taking the machine.
# Not under AddressSanitizer (make sanitize): it reserves terabytes of address space for its shadow memory, and
# catches runaway allocations itself (allocation-size-too-big).
_limit = int(os.environ.get("FUZZ_MEMORY_LIMIT_MB", "12288")) << 20
if "libasan" not in os.environ.get("LD_PRELOAD", ""):
    resource.setrlimit(resource.RLIMIT_AS, (_limit, _limit))

import targets  # noqa: E402


def main() -> int:
    progress, result_fd = sys.argv[1], int(sys.argv[2])
    out = os.fdopen(result_fd, "w", buffering=1)
    targets.setup_process()
    out.write("ready\n")
    prepared: set = set()
    for line in sys.stdin:
        index, target, path = line.rstrip("\n").split("\t")
        if target not in prepared:
            targets.prepare(target)
            prepared.add(target)
        with open(progress, "w") as f:
            f.write(index)
        outcome, detail = targets.evaluate(target, path)
        out.write(json.dumps({"index": int(index), "outcome": outcome, "detail": detail[:2000]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
