"""gpucast: forecast a training run's GPU memory and step time from its first iteration.

``import gpucast`` loads the C++ plugin (``torch.ops.gpucast.*``); it records nothing until asked.
"""
from __future__ import annotations

from ._loader import library_path, load

load()

from ._trace import Trace, load_trace, trace, trace_options  # noqa: E402
from ._forecast import forecast  # noqa: E402
from ._results import Forecast, MemoryForecast  # noqa: E402
from ._settings import devices, gpu_rates, interconnects  # noqa: E402
from ._auto import OutOfMemoryRisk, OutOfMemoryRiskWarning  # noqa: E402
from . import _auto  # noqa: E402
from .trackers import log_to  # noqa: E402
from ._job import describe, describe_config, predict_job  # noqa: E402
from ._calibrate import calibrate  # noqa: E402
from ._ranks import simulated_ranks  # noqa: E402

# The public classes are gpucast's: tracebacks, reprs and pickles name gpucast.OutOfMemoryRisk, not the private
# module that defines it.
for _cls in (Trace, trace, Forecast, MemoryForecast, OutOfMemoryRisk, OutOfMemoryRiskWarning):
    _cls.__module__ = __name__
del _cls

_auto.maybe_start()

__version__ = __import__("torch").ops.gpucast.version()

__all__ = ["calibrate", "OutOfMemoryRisk", "OutOfMemoryRiskWarning", "Forecast", "MemoryForecast", "Trace", "describe", "describe_config", "devices", "forecast", "gpu_rates", "interconnects", "library_path", "log_to", "load_trace", "predict_job", "simulated_ranks", "trace",
           "trace_options", "__version__"]
