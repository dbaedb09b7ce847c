"""gpucast's build backend: scikit-build-core's, once what the build needs is found.

`pip install --no-build-isolation .` builds the plugin against the torch already installed, with the build tools
already installed; when one is missing, pip would end in a traceback (BackendUnavailable: No module named
'scikit_build_core'). Here every build hook instead says, in one message, what is missing and the pip command
that installs it. pyproject.toml names this module (backend-path); nothing else imports it.
"""
import importlib.util
import shutil
import sys

# (module, what pip installs, why): checked without importing them (torch takes seconds to import).
_NEEDED = (("scikit_build_core", "scikit-build-core", "the build backend"),
           ("torch", "torch", "the plugin is built against the installed torch"))


def missing() -> list:
    """The pip names of what the build needs and cannot find, in _NEEDED's order; cmake when neither the cmake
    package nor a cmake program is there."""
    out = [pkg for mod, pkg, _ in _NEEDED if importlib.util.find_spec(mod) is None]
    if importlib.util.find_spec("cmake") is None and shutil.which("cmake") is None:
        out.append("cmake")
    return out


def message(names: list) -> str:
    return (f"gpucast: the build needs {', '.join(names)}, which this Python does not have. Install "
            f"{'it' if len(names) == 1 else 'them'}, then run the same command again:\n    pip install {' '.join(names)}\n"
            "(pip install --no-build-isolation builds with what is installed, so that the plugin matches the "
            "installed torch.)\n")


_MISSING = missing()

if _MISSING:
    def _refuse(*args, **kwargs):
        sys.stderr.write(message(_MISSING))
        raise SystemExit(1)

    get_requires_for_build_wheel = get_requires_for_build_sdist = get_requires_for_build_editable = _refuse
    prepare_metadata_for_build_wheel = prepare_metadata_for_build_editable = _refuse
    build_wheel = build_sdist = build_editable = _refuse
else:
    from scikit_build_core.build import *  # noqa: F401,F403  (the hooks pip calls)
