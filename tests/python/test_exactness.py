"""Exactness: gpucast's memory events equal torch.profiler's, event by event, to the byte."""
import pytest
import torch
from torch._C._profiler import _EventType

import gpucast
from conftest import all_cases, build

CASES = all_cases()


def profiler_memory_events(prof):
    """(ptr, ±bytes) of CPU allocations and frees, in order."""
    out = []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    flat = []
    while stack:
        e = stack.pop()
        flat.append(e)
        stack.extend(reversed(e.children))
    allocs = [e for e in flat if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"]
    allocs.sort(key=lambda e: e.start_time_ns)
    for e in allocs:
        out.append((e.extra_fields.ptr, e.extra_fields.alloc_size))
    return out


def running(events):
    totals, held = [], 0
    for _, b in events:
        held += b
        totals.append(held)
    return totals


START_MARK, END_MARK = 12345, 54321  # odd sizes that bracket gpucast's window in the profiler's stream


def window(events):
    """The profiler's events strictly between the start and end marker allocations."""
    begin = next(i for i, (_, b) in enumerate(events) if b == START_MARK)
    end = next(i for i, (_, b) in enumerate(events) if b == END_MARK and i > begin)
    return events[begin + 1:end]


@pytest.mark.parametrize("name", sorted(CASES))
def test_memory_events_equal_torch_profiler(name):
    # The profiler knows a block's size only if it saw the allocation: start it before the model exists.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model, opt, step, batch = build(CASES[name], "adamw")
        step(batch)
        start = torch.empty(START_MARK, dtype=torch.uint8)
        with gpucast.trace() as t:
            step(batch)
        end = torch.empty(END_MARK, dtype=torch.uint8)
    del start, end
    theirs = window(profiler_memory_events(prof))
    ours = [(e.ptr, e.bytes) for e in t.events if e.device == "cpu"]
    assert len(ours) > 10
    assert ours == theirs
    assert running(ours) == running(theirs)
    assert t.peak_bytes("cpu") == max([0] + running(theirs))
    assert t.counters["unmatched_frees"] == 0
