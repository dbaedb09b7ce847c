"""The C++ layers link one way: common -> profiler -> predictor -> plugin. A file includes headers of its own layer
or of a lower one, never of a higher one; a private header (not under include/) only from its own folder. The build
enforces the same through one CMake target per layer with PRIVATE include directories; this test names the file
and the include where a change breaks the rule."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("common", "profiler", "predictor", "plugin")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def public_headers() -> dict:
    """gpucast/<name>.h -> the layer whose include/ folder holds it."""
    out = {}
    for layer in LAYERS:
        for h in (ROOT / layer / "include" / "gpucast").glob("*.h"):
            assert f"gpucast/{h.name}" not in out, f"gpucast/{h.name} is public in two layers"
            out[f"gpucast/{h.name}"] = layer
    return out


def sources(layer: str) -> list:
    return sorted(p for p in (ROOT / layer).rglob("*") if p.suffix in (".h", ".cpp"))


def file_violations(path: Path, layer: str, text: str, headers: dict) -> list:
    """The includes of one file (its text, standing at path in layer) that break the rule."""
    out = []
    for inc in INCLUDE.findall(text):
        if inc in headers:
            if LAYERS.index(headers[inc]) > LAYERS.index(layer):
                out.append(f"{path.relative_to(ROOT)} ({layer}) includes {inc} of the {headers[inc]} layer")
        elif inc.startswith("gpucast/"):
            out.append(f"{path.relative_to(ROOT)} includes {inc}, which no layer's include/ folder holds")
        elif not (path.parent / inc).is_file():
            out.append(f"{path.relative_to(ROOT)} includes the private header {inc} of another folder")
    return out


def violations() -> list:
    headers = public_headers()
    return [v for layer in LAYERS for path in sources(layer)
            for v in file_violations(path, layer, path.read_text(), headers)]


def test_every_layer_below_the_plugin_has_public_headers():
    # The plugin is the top: no layer includes it. Its one public header is for the programs outside that link it
    # (LibTorch training loops: examples/cpp/train.cpp), and no file of the layers includes it.
    headers = public_headers()
    assert {headers[h] for h in headers if headers[h] != "plugin"} == set(LAYERS[:-1])
    assert sorted(h for h in headers if headers[h] == "plugin") == ["gpucast/gpucast.h"]
    assert not [p for layer in LAYERS for p in sources(layer)
                if "gpucast/gpucast.h" in INCLUDE.findall(p.read_text())]


def test_no_layer_includes_a_higher_one():
    assert violations() == []


@pytest.mark.parametrize("header,layer", [("gpucast/config.h", "common"), ("gpucast/error.h", "common"),
                                          ("gpucast/trace.h", "profiler"), ("gpucast/step_time.h", "predictor")])
def test_shared_headers_live_in_their_layer(header, layer):
    assert public_headers()[header] == layer


def test_the_check_names_an_upward_and_a_foreign_private_include():
    plugin_header = "gpucast/ops_probe.h"
    headers = {**public_headers(), plugin_header: "plugin"}
    at = ROOT / "predictor" / "probe.cpp"
    text = f'#include "{plugin_header}"\n#include "gpucast/trace.h"\n#include "memory_sink.h"\n'
    assert file_violations(at, "predictor", text, headers) == [
        f"predictor/probe.cpp (predictor) includes {plugin_header} of the plugin layer",
        "predictor/probe.cpp includes the private header memory_sink.h of another folder"]


RAW_PARSE = re.compile(r"\bjson::parse\s*\(")


def test_every_parser_reads_outside_json_through_json_input():
    # gpucast/json_input.h's parse_json_input checks depth and UTF-8 before parsing and turns every error into a
    # UserError naming the source; nlohmann's parse called directly does neither.
    found = [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
             for layer in LAYERS for path in sources(layer) if path.name != "json_input.cpp"
             for text in [path.read_text()] for m in RAW_PARSE.finditer(text)]
    assert found == []
