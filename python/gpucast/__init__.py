"""gpucast: forecast a training run's GPU memory and step time from its first iteration.

``import gpucast`` loads the C++ plugin (``torch.ops.gpucast.*``); it records nothing until asked.
"""
from __future__ import annotations

from ._loader import library_path, load

load()

from ._trace import Trace, load_trace, trace, trace_options  # noqa: E402
from ._forecast import Forecast, MemoryForecast, devices, forecast  # noqa: E402

__version__ = __import__("torch").ops.gpucast.version()

__all__ = ["Forecast", "MemoryForecast", "Trace", "devices", "forecast", "library_path", "load_trace", "trace",
           "trace_options", "__version__"]
