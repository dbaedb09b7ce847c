"""Seeded mutations of gpucast's inputs: bytes, JSON documents, configuration strings and weights files.

Every function takes a random.Random and returns new bytes; the same seed gives the same inputs. Structure-aware
mutations parse the seed (JSON with duplicate keys kept, the weights file's header and tensors, the configuration
grammar's separators) and change one part the way a broken writer, a hand edit or a hostile file would: extreme
numbers, another type, deep nesting, indices past the end of the array they index, duplicate or missing keys,
huge strings, invalid UTF-8. Sizes stay within max_bytes.
"""
from __future__ import annotations

import array
import copy
import json
import math
import random
import re
import struct

# Number texts that break readers: overflow of double, int64, uint64, uint32, float32; negative and zero sizes;
# fractions where integers go; texts that are not JSON numbers at all.
EXTREME_NUMBERS = [
    "1e400", "-1e400", "1e-400", "-1", "0", "-0", "-0.0", "0.5", "1.5", "3e38", "-3e38", "1e308", "1.7976931348623157e308",
    "2147483647", "2147483648", "-2147483649", "4294967295", "4294967296", "4294967297",
    "9223372036854775807", "9223372036854775808", "-9223372036854775808", "-9223372036854775809",
    "18446744073709551615", "18446744073709551616", "18446744073709551617", "1e19", "-1e19",
    "340282366920938463463374607431768211457", "1" + "0" * 400, "NaN", "Infinity", "-Infinity", "1e", "01", "0x10",
]
# Fields that index another array of the same document (trace: ops, events, allocations; step graph: nodes).
INDEX_KEYS = {"alloc_op", "free_op", "alloc_event", "free_event", "allocation", "op", "parent", "fwd_op", "bwd_node",
              "fwd_thread", "thread", "id", "seq", "start_seq", "end_seq", "depth", "nested", "seq_nr", "src", "dst"}
OTHER_TYPES = ['"x"', '"12"', '""', "null", "true", "false", "[]", "{}", "[1,2]", '{"a":1}', "0", "-1", '["a"]']
INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\x80", b"\xf8\x88\x80\x80\x80",
                b"\xf4\x90\x80\x80"]
JSON_BYTES = b'[]{}",:\\ 0-e.\x00\n'


class Obj(list):
    """A JSON object as a list of [key, value] pairs: order and duplicate keys kept."""


class Raw:
    """JSON text put into the document as is (a number JSON cannot hold, deep nesting, bad bytes)."""

    def __init__(self, data: bytes | str):
        self.data = data.encode() if isinstance(data, str) else data


def loads(data: bytes):
    return json.loads(data, object_pairs_hook=lambda pairs: Obj([list(kv) for kv in pairs]))


def dumps(value) -> bytes:
    out: list[bytes] = []
    _dump(value, out)
    return b"".join(out)


def _dump(v, out: list) -> None:
    if isinstance(v, Raw):
        out.append(v.data)
    elif isinstance(v, Obj):
        out.append(b"{")
        for i, (k, x) in enumerate(v):
            if i:
                out.append(b",")
            _dump(k, out)
            out.append(b":")
            _dump(x, out)
        out.append(b"}")
    elif isinstance(v, list):
        out.append(b"[")
        for i, x in enumerate(v):
            if i:
                out.append(b",")
            _dump(x, out)
        out.append(b"]")
    elif isinstance(v, float) and not math.isfinite(v):
        out.append(b"1e400")
    else:
        out.append(json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _nodes(doc, limit: int = 200_000) -> list:
    """(container, slot, key name) of every value below the root: container[slot] is the value."""
    out, stack = [], [(doc, None)]
    while stack and len(out) < limit:
        v, _ = stack.pop()
        if isinstance(v, Obj):
            for pair in v:
                out.append((pair, 1, pair[0]))
                stack.append((pair[1], pair[0]))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                out.append((v, i, None))
                stack.append((x, None))
    return out


def _containers(doc) -> list:
    out, stack = [], [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, (Obj, list)):
            out.append(v)
            stack.extend(p[1] for p in v) if isinstance(v, Obj) else stack.extend(v)
    return out


def _longest_list(doc) -> int:
    return max((len(c) for c in _containers(doc) if not isinstance(c, Obj)), default=0)


def _deep(rng: random.Random, max_bytes: int) -> Raw:
    depth = rng.choice([64, 512, 1000, 5000, 20000, 100000])
    depth = max(1, min(depth, max_bytes // 8))
    if rng.random() < 0.75:
        return Raw(b"[" * depth + b"1" + b"]" * depth)
    return Raw(b'{"a":' * depth + b"1" + b"}" * depth)


# ---- JSON ------------------------------------------------------------------------------------------------------


def mutate_json(rng: random.Random, data: bytes, max_bytes: int) -> bytes:
    """One to three structure-aware changes, sometimes followed by a byte-level one; bytes alone where the seed is
    not JSON."""
    try:
        doc = loads(data)
    except (ValueError, RecursionError):
        return mutate_bytes(rng, data, max_bytes)
    if rng.random() < 0.2:
        return mutate_bytes(rng, data, max_bytes)
    try:
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            doc = _json_once(rng, doc, max_bytes)
        out = dumps(doc)
    except RecursionError:  # a seed deeper than Python's stack: bytes only
        return mutate_bytes(rng, data, max_bytes)
    if rng.random() < 0.15:
        out = mutate_bytes(rng, out, max_bytes)
    return out[:max_bytes]


def _json_once(rng: random.Random, doc, max_bytes: int):
    nodes = _nodes(doc)
    if not nodes:
        return _deep(rng, max_bytes) if rng.random() < 0.5 else Raw(rng.choice(OTHER_TYPES))
    op = rng.choices(["number", "index", "type", "deep", "remove_key", "dup_key", "huge_string", "list", "string",
                      "swap", "root"], weights=[20, 20, 10, 6, 8, 6, 4, 10, 6, 4, 1])[0]
    numbers = [n for n in nodes if isinstance(n[0][n[1]], (int, float)) and not isinstance(n[0][n[1]], bool)]
    if op == "number" and numbers:
        c, s, _ = rng.choice(numbers)
        c[s] = Raw(rng.choice(EXTREME_NUMBERS))
    elif op == "index" and numbers:
        keyed = [n for n in numbers if n[2] in INDEX_KEYS] or numbers
        c, s, _ = rng.choice(keyed)
        n = _longest_list(doc)
        c[s] = rng.choice([n, n + 1, n + rng.randint(2, 1000), 2**31 - 1, 2**31, 2**32 + 1, 2**63 - 1, -2, -(2**31),
                           10**6, -(2**63)])
    elif op == "type":
        c, s, _ = rng.choice(nodes)
        c[s] = Raw(rng.choice(OTHER_TYPES))
    elif op == "deep":
        c, s, _ = rng.choice(nodes)
        c[s] = _deep(rng, max_bytes)
    elif op in ("remove_key", "dup_key"):
        objs = [c for c in _containers(doc) if isinstance(c, Obj) and c]
        if objs:
            o = rng.choice(objs)
            i = rng.randrange(len(o))
            if op == "remove_key":
                del o[i]
            else:
                o.insert(rng.randrange(len(o) + 1), [o[i][0], Raw(rng.choice(OTHER_TYPES + EXTREME_NUMBERS))])
    elif op == "huge_string":
        c, s, _ = rng.choice(nodes)
        n = min(rng.choice([1000, 65536, 1 << 20]), max(1, max_bytes // 2))
        c[s] = rng.choice(["A", "\u00e9", "\U0001f600", "\\"]) * (n // 4 if c[s] == "\\" else n)
    elif op == "list":
        lists = [c for c in _containers(doc) if not isinstance(c, Obj)]
        if lists:
            lst = rng.choice(lists)
            what = rng.choice(["del", "dup", "clear", "shuffle", "half", "extend"])
            if what == "del" and lst:
                del lst[rng.randrange(len(lst))]
            elif what == "dup" and lst:
                i = rng.randrange(len(lst))
                lst.insert(i, lst[i])
            elif what == "clear":
                lst.clear()
            elif what == "shuffle":
                rng.shuffle(lst)
            elif what == "half":
                del lst[len(lst) // 2:]
            elif what == "extend" and lst:
                lst.extend(lst[: max(1, min(len(lst), 200))])
    elif op == "string":
        strings = [n for n in nodes if isinstance(n[0][n[1]], str)]
        if strings:
            c, s, _ = rng.choice(strings)
            bad = rng.choice(INVALID_UTF8 + [b"\\ud800", b"\\udfff", b"\\u0000", b"\\uZZZZ", b"\\"])
            text = c[s].encode("utf-8", "surrogatepass")
            cut = rng.randint(0, len(text))
            c[s] = Raw(b'"' + text[:cut].replace(b'"', b"") + bad + text[cut:].replace(b'"', b"") + b'"')
    elif op == "swap" and len(nodes) > 1:
        (c1, s1, _), (c2, s2, _) = rng.sample(nodes, 2)
        v1, v2 = c1[s1], c2[s2]
        c1[s1], c2[s2] = copy.deepcopy(v2), copy.deepcopy(v1)  # copies: a value swapped into its own part is no cycle
    elif op == "root":
        return Raw(rng.choice(OTHER_TYPES)) if rng.random() < 0.5 else _deep(rng, max_bytes)
    return doc


# ---- bytes -----------------------------------------------------------------------------------------------------


def mutate_bytes(rng: random.Random, data: bytes, max_bytes: int, others: list[bytes] | None = None) -> bytes:
    """One to four byte-level changes: bit flips, random or JSON-significant bytes, inserts, deletes, repeats,
    truncation, invalid UTF-8, a splice with another seed."""
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4])):
        op = rng.choice(["flip", "set", "insert", "delete", "repeat", "truncate", "utf8", "splice"])
        pos = rng.randint(0, len(b))
        if op == "flip" and b:
            i = min(pos, len(b) - 1)
            b[i] ^= 1 << rng.randrange(8)
        elif op == "set" and b:
            i = min(pos, len(b) - 1)
            b[i] = rng.choice([rng.randrange(256), rng.choice(JSON_BYTES)])
        elif op == "insert":
            n = rng.choice([1, 1, 2, 8, 64])
            b[pos:pos] = bytes(rng.choice([rng.randrange(256), rng.choice(JSON_BYTES)]) for _ in range(n))
        elif op == "delete" and b:
            del b[pos:pos + rng.choice([1, 1, 4, 64, 4096])]
        elif op == "repeat" and b:
            seg = bytes(b[pos:pos + rng.choice([1, 8, 64, 1024])])
            b[pos:pos] = seg * rng.choice([2, 16, 256])
        elif op == "truncate":
            del b[pos:]
        elif op == "utf8":
            b[pos:pos] = rng.choice(INVALID_UTF8)
        elif op == "splice" and others:
            o = rng.choice(others)
            j = rng.randint(0, len(o))
            b[pos:] = o[j:]
        if len(b) > max_bytes:
            del b[max_bytes:]
    return bytes(b)


# ---- configuration strings -------------------------------------------------------------------------------------

SEPARATORS = [",", ":", "[", "]", ">", ";", "/", "|", "=", " ", ",,", "::", "[]", "[[", "]]"]
CONFIG_VALUES = ["", "0", "-1", "1", "1e400", "-1e400", "1e-400", "nan", "NaN", "inf", "-inf", "0x10", "1_000", " 3",
                 "3 ", "+5", "0.0000001", "True", "False", "true", "TRUE", "[", "]", "[1,2]", "[[]]", "[>:8]",
                 "2147483648", "4294967297", "9223372036854775807", "9223372036854775808", "-9223372036854775808",
                 "18446744073709551616", "1" * 400, "1e19", "\u00e9t\u00e9", "\U0001f600", "a" * 100]


def mutate_config(rng: random.Random, text: str, max_bytes: int, words: list[str], env: bool) -> str:
    """Changes in the configuration grammar (key:value,key:[a,b]): values replaced by extremes, items shuffled,
    dropped or repeated, keys swapped, separators and brackets added, deep brackets, huge values; env: the text
    goes through an environment variable, so it may carry bytes that are not UTF-8 (as os.environ gives them)."""
    if rng.random() < 0.15:
        raw = mutate_bytes(rng, text.encode("utf-8", "surrogateescape"), max_bytes)
        if not env:
            return raw.decode("utf-8", "replace").replace("\x00", "")
        return raw.replace(b"\x00", b"").decode("utf-8", "surrogateescape")
    for _ in range(rng.choice([1, 1, 2, 3])):
        parts = re.split(r"([,:\[\]>;/|])", text)
        op = rng.choice(["value", "value", "value", "shuffle", "drop", "repeat", "key", "sep", "deep", "huge",
                         "empty_item"])
        values = [i for i, p in enumerate(parts) if i % 2 == 0]
        if op == "value" and values:
            parts[rng.choice(values)] = rng.choice(CONFIG_VALUES + words)
            text = "".join(parts)
        elif op in ("shuffle", "drop", "repeat"):
            items = _top_level_items(text)
            if op == "shuffle":
                rng.shuffle(items)
            elif op == "drop" and items:
                del items[rng.randrange(len(items))]
            elif op == "repeat" and items:
                i = rng.randrange(len(items))
                items.insert(i, items[i] if rng.random() < 0.5 else
                             items[i].split(":")[0] + ":" + rng.choice(CONFIG_VALUES))
            text = ",".join(items)
        elif op == "key" and values:
            parts[rng.choice(values)] = rng.choice(words) if words else "x"
            text = "".join(parts)
        elif op == "sep":
            pos = rng.randint(0, len(text))
            text = text[:pos] + rng.choice(SEPARATORS) + text[pos:]
        elif op == "deep":
            n = min(rng.choice([16, 1000, 100000]), max_bytes // 2)
            pos = rng.randint(0, len(text))
            text = text[:pos] + "[" * n + ("]" * n if rng.random() < 0.5 else "") + text[pos:]
        elif op == "huge":
            n = min(rng.choice([1000, 65536]), max_bytes)
            pos = rng.randint(0, len(text))
            text = text[:pos] + rng.choice(["9", "a", ",", ":", "[1,"]) * (n // 4) + text[pos:]
        elif op == "empty_item":
            text = rng.choice([",", ":", ",:", ":,"]) + text if rng.random() < 0.5 else text + rng.choice([",", ":"])
    if env and rng.random() < 0.05:
        pos = rng.randint(0, len(text))
        text = text[:pos] + rng.choice(["\udcff", "\udcc0\udcaf", "\udce2\udc82"]) + text[pos:]
    return text[:max_bytes]


def _top_level_items(text: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth <= 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return items


def config_words(texts: list[str]) -> list[str]:
    """The keys and values of the seeds: what a token swap draws from."""
    words = set()
    for t in texts:
        words.update(w for w in re.split(r"[,:\[\]>;/|]", t) if w)
    return sorted(words)


# ---- weights files ---------------------------------------------------------------------------------------------

MAGIC = b"GPUCASTJ"
EXTREME_FLOATS = [3e38, -3e38, float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 0.0, -0.0, 1e-45, 65504e3]


def fnv1a(b: bytes) -> int:
    """The weights file's checksum (weights_file.cpp): FNV-1a over everything before it."""
    h = 1469598103934665603
    for x in b:
        h = ((h ^ x) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def parse_weights(data: bytes) -> dict | None:
    """{"version", "header" (bytes), "tensors": [(name bytes, shape list, float32 array)]}; None if not one."""
    try:
        if data[:8] != MAGIC:
            return None
        version, hlen = struct.unpack_from("<II", data, 8)
        pos = 16
        header = data[pos:pos + hlen]
        pos += hlen
        (count,) = struct.unpack_from("<I", data, pos)
        pos += 4
        tensors = []
        for _ in range(count):
            (nlen,) = struct.unpack_from("<I", data, pos)
            pos += 4
            name = data[pos:pos + nlen]
            pos += nlen
            (rank,) = struct.unpack_from("<I", data, pos)
            pos += 4
            shape = list(struct.unpack_from(f"<{rank}q", data, pos))
            pos += 8 * rank
            n = math.prod(shape)
            values = array.array("f")
            values.frombytes(data[pos:pos + 4 * n])
            pos += 4 * n
            tensors.append([name, shape, values])
        return {"version": version, "header": header, "tensors": tensors}
    except (struct.error, ValueError, MemoryError):
        return None


def build_weights(w: dict, checksum: bool = True) -> bytes:
    out = bytearray(MAGIC)
    out += struct.pack("<II", w["version"], len(w["header"]))
    out += w["header"]
    out += struct.pack("<I", len(w["tensors"]))
    for name, shape, values in w["tensors"]:
        out += struct.pack("<I", len(name)) + name + struct.pack("<I", len(shape))
        out += struct.pack(f"<{len(shape)}q", *shape)
        out += values.tobytes()
    return bytes(out) + (struct.pack("<Q", fnv1a(bytes(out))) if checksum else b"\0" * 8)


def fix_checksum(data: bytes) -> bytes:
    if len(data) < 8:
        return data
    return data[:-8] + struct.pack("<Q", fnv1a(data[:-8]))


def mutate_weights(rng: random.Random, data: bytes, max_bytes: int) -> bytes:
    """A weights file changed where its checksum still holds (most often) or not: extreme or non-finite weights,
    a normalisation statistic set to zero or an extreme, the header's JSON mutated, shapes that disagree with the
    data or whose product overflows, tensors dropped, repeated or renamed, a wrong count or version; else bytes
    flipped, with the checksum fixed after them or not."""
    w = parse_weights(data)
    r = rng.random()
    if w is None or r < 0.2:
        out = mutate_bytes(rng, data, max_bytes)
        return fix_checksum(out) if rng.random() < 0.7 else out
    op = rng.choices(["value", "scale", "stat", "header", "shape", "shape_overflow", "tensors", "count", "version"],
                     weights=[25, 6, 25, 15, 8, 4, 8, 3, 2])[0]
    tensors = w["tensors"]
    if op == "value" and tensors:
        _, _, values = rng.choice(tensors)
        for _ in range(rng.choice([1, 1, 3])):
            if values:
                values[rng.randrange(len(values))] = rng.choice(EXTREME_FLOATS)
    elif op == "scale" and tensors:
        name, shape, values = rng.choice(tensors)
        k = rng.choice([0.0, 1e10, -1.0, 1e-30])
        values[:] = array.array("f", [(v * k if math.isfinite(v * k) else 3e38) for v in values])
    elif op in ("stat", "header"):
        try:
            doc = loads(w["header"])
        except ValueError:
            doc = None
        if doc is None or op == "header":
            w["header"] = mutate_json(rng, w["header"], max_bytes // 2)
        else:
            stats = [n for n in _nodes(doc) if isinstance(n[0][n[1]], list)
                     and any(isinstance(x, (int, float)) for x in n[0][n[1]])]
            if stats:
                c, s, _ = rng.choice(stats)
                lst = c[s]
                i = rng.randrange(len(lst))
                lst[i] = rng.choice([0, 0.0, -1.0, 1e-30, 1e30, 3e38, Raw("1e400"), Raw("-1e400"), 1e-45])
            w["header"] = dumps(doc)
    elif op == "shape" and tensors:
        t = rng.choice(tensors)
        shape = list(t[1])
        what = rng.choice(["dim", "rank", "swap", "zero"])
        if what == "dim" and shape:
            i = rng.randrange(len(shape))
            shape[i] = max(0, shape[i] + rng.choice([-1, 1, 7]))
        elif what == "rank":
            shape = shape + [1] if rng.random() < 0.5 or not shape else shape[:-1]
        elif what == "swap":
            shape = shape[::-1]
        elif what == "zero" and shape:
            shape[rng.randrange(len(shape))] = 0
        t[1] = shape
        if rng.random() < 0.6:  # data resized to the new shape: the file stays consistent
            n = math.prod(shape)
            vals = t[2]
            t[2] = array.array("f", (list(vals) + [0.0] * n)[:n])
    elif op == "shape_overflow" and tensors:
        t = rng.choice(tensors)
        t[1] = rng.choice([[2**32, 2**32], [2**32] * 4, [2**31, 2**31, 4], [2**32, 2**31, 2**31, 2], [-1, -1],
                           [1] * 9, [2**32 + 1]])
    elif op == "tensors" and tensors:
        what = rng.choice(["drop", "dup", "rename", "reorder"])
        i = rng.randrange(len(tensors))
        if what == "drop":
            del tensors[i]
        elif what == "dup":
            tensors.insert(i, [tensors[i][0], list(tensors[i][1]), array.array("f", tensors[i][2])])
        elif what == "rename":
            tensors[i][0] = rng.choice([b"", b"x", tensors[i][0] + b".extra", b"\xff\xfe"])
        else:
            rng.shuffle(tensors)
    elif op == "version":
        w["version"] = rng.choice([0, 2, 2**32 - 1])
    out = build_weights(w)
    if op == "count":
        out = bytearray(out[:-8])
        hl = struct.unpack_from("<I", out, 12)[0]
        struct.pack_into("<I", out, 16 + hl, rng.choice([0, len(tensors) + 1, 2**32 - 1, max(0, len(tensors) - 1)]))
        out = bytes(out) + b"\0" * 8
        out = fix_checksum(out)
    return out[:max_bytes] if len(out) <= max_bytes else fix_checksum(out[:max_bytes])
