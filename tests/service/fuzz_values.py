"""Values for the protobuf fuzzer (test_fuzz.py): each kind of a field type's extremes drawn as often as ordinary
values; repeated fields and maps empty, short or many thousands long; whole messages from descriptors, and
changes of one or two fields of a given message."""

import copy
import functools
import itertools
import math

import numpy as np
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_MIN_NORMAL = float(np.finfo(np.float32).tiny)
# Each kind of extreme is drawn as often as ordinary values: float32 max and its neighbour down; large finite
# values; the smallest normal and subnormals; infinities and NaN; the edges of the documented ranges
# (docs/api.md#valid-ranges) and the float32 just past each.
FLOATS = {
    "max": [FLOAT32_MAX, float(np.nextafter(np.float32(FLOAT32_MAX), np.float32(0))), 3.4e38, -FLOAT32_MAX],
    "large": [1e38, 1e37, 1e30, 1e20, 65504.0, 1100.0, -1100.0, -1e37],
    "tiny": [FLOAT32_MIN_NORMAL, 1e-38, 1.4e-45, 1e-45, -1.4e-45, 1e-30, 1e-7, -0.0],
    "special": [math.inf, -math.inf, math.nan],
    "edges": [0.0, 0.5, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0, 100.0, -100.0, 0.01] + [
        float(np.nextafter(np.float32(edge), np.float32(toward))) for edge, toward in (
            (2, 3), (-2, -3), (1, 2), (1, 0), (4, 5), (-4, -5), (100, 101), (-100, -101), (0.01, 0))],
}
# Around a KV block (16), the test worker's max_model_len (64), num_beams' limit (32) and the vocabulary (256);
# int32, uint32, int64 and uint64 limits; negatives.
INTS = {
    "small": [0, 1, 2, 3, 15, 16, 17, 20, 21, 32, 33, 63, 64, 65, 255, 256, 257, 2**16],
    "32": [2**31 - 1, 2**31, 2**31 + 1, 2**32 - 2, 2**32 - 1],
    "64": [2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1],
    "negative": [-1, -2, -1100, -(2**31) + 1, -(2**31), -(2**63) + 1, -(2**63)],
}
HUGE_LENGTHS = [1000, 4096, 20000, 65536]
HUGE_MAP_SIZES = [256, 257, 5000, 20000]


def extremes(kinds: dict, ordinary: st.SearchStrategy) -> st.SearchStrategy:
    """A kind of extreme, or an ordinary value, with equal odds (one_of picks its branches evenly)."""
    return st.one_of(*(st.sampled_from(values) for values in kinds.values() if values), ordinary)


def ints(low: int, high: int) -> st.SearchStrategy:
    kinds = {kind: [v for v in values if low <= v <= high] for kind, values in INTS.items()}
    return extremes(kinds, st.one_of(st.integers(max(low, 0), 300), st.integers(low, high)))


@functools.cache
def scalar(field) -> st.SearchStrategy:
    t = field.type
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return ints(0, 2**32 - 1)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return ints(0, 2**64 - 1)
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return ints(-(2**31), 2**31 - 1)
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return ints(-(2**63), 2**63 - 1)
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return extremes(FLOATS, st.one_of(st.floats(-2.0, 2.0, width=32), st.floats(width=32)))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        huge = ["", "\x00", "a" * 100_000, "\u00e9\U0001f600" * 30_000]
        return st.one_of(st.text(max_size=40), st.sampled_from(huge))
    if t == F.TYPE_BYTES:
        return st.binary(max_size=40)
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from([-1, len(known), 2**31 - 1, -(2**31)]))
    raise AssertionError(f"no strategy for field type {t}")


def _listed(field) -> list:
    """Values a huge list or map cycles through."""
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return [v for values in FLOATS.values() for v in values]
    return [0, 5, 255, 256, 2**31, 2**32 - 1]


@functools.cache
def repeated(field) -> st.SearchStrategy:
    """A repeated scalar field's values: none, a few, or thousands (one value, a count, or the extremes in turn)."""
    element, listed = scalar(field), _listed(field)
    if field.type in (F.TYPE_STRING, F.TYPE_BYTES, F.TYPE_BOOL, F.TYPE_ENUM):
        return st.lists(element, max_size=8)
    counted = field.type not in (F.TYPE_FLOAT, F.TYPE_DOUBLE)
    patterns = [lambda n, v: [v] * n, lambda n, v: list(itertools.islice(itertools.cycle(listed), n))]
    if counted:
        patterns += [lambda n, v: [i % 256 for i in range(n)], lambda n, v: list(range(n))]
    huge = st.builds(lambda make, n, v: make(n, v), st.sampled_from(patterns), st.sampled_from(HUGE_LENGTHS),
                     element)
    return st.one_of(st.just([]), st.lists(element, min_size=1, max_size=8), huge)


@functools.cache
def mapping(field) -> st.SearchStrategy:
    """A map field's entries: none, a few, or thousands of keys counting from 0 with one value or the extremes."""
    key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
    listed = _listed(value)
    huge = st.builds(lambda n, v, same: {k: v if same else listed[k % len(listed)] for k in range(n)},
                     st.sampled_from(HUGE_MAP_SIZES), scalar(value), st.booleans())
    return st.one_of(st.just({}), st.dictionaries(scalar(key), scalar(value), min_size=1, max_size=6), huge)


def is_map(field) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


@functools.cache
def message(descriptor, depth: int = 0) -> st.SearchStrategy:
    """A dict of field values for a message (unset fields left out), nested messages to depth 3."""
    parts = {}
    for field in descriptor.fields:
        if is_map(field):
            parts[field.name] = mapping(field)
        elif field.type == F.TYPE_MESSAGE:
            if depth < 3:
                value = message(field.message_type, depth + 1)
                parts[field.name] = st.lists(value, max_size=6) if field.is_repeated else value
        else:
            parts[field.name] = repeated(field) if field.is_repeated else scalar(field)
    return st.fixed_dictionaries({}, optional=parts)


def build(cls, values: dict):
    out = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        if is_map(field):
            getattr(out, name).update(value)
        elif field.type == F.TYPE_MESSAGE:
            sub = field.message_type._concrete_class
            if field.is_repeated:
                getattr(out, name).extend(build(sub, v) for v in value)
            else:
                getattr(out, name).CopyFrom(build(sub, value))
        elif field.is_repeated:
            getattr(out, name).extend(value)
        else:
            setattr(out, name, value)
    return out


def weight(field) -> int:
    """How often a field is drawn for a change: floats three times, other numbers twice (where a value that gets
    past validation can still break the engine), the rest once."""
    if field.is_repeated or field.type in (F.TYPE_MESSAGE, F.TYPE_BOOL, F.TYPE_STRING, F.TYPE_BYTES):
        return 1
    return 3 if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE) else 2


def field_paths(request, prefix: tuple = ()):
    """(path, field) for every field under request, a repeated message field both as a list and through its first
    element; a path names fields from the top."""
    for field in request.DESCRIPTOR.fields:
        path = prefix + (field.name,)
        if field.type != F.TYPE_MESSAGE or is_map(field):
            yield path, field
        elif field.is_repeated:
            yield path, field
            if len(getattr(request, field.name)):
                yield from field_paths(getattr(request, field.name)[0], path)
        elif len(prefix) < 3:
            yield from field_paths(getattr(request, field.name), path)


@functools.cache
def extreme(field) -> st.SearchStrategy:
    if is_map(field):
        return mapping(field)
    if field.type == F.TYPE_MESSAGE:        # a list of messages: emptied, or its first element many times
        return st.sampled_from([0, 2, 33, 1000, 5000])
    return repeated(field) if field.is_repeated else scalar(field)


def set_path(request, path: tuple, field, value) -> None:
    """Sets the field at path to value; nothing where the path no longer leads anywhere (the first of two changes
    emptied a list on it, or chose another member of a oneof above it)."""
    parent = request
    for name in path[:-1]:
        parent = getattr(parent, name)
        if not hasattr(parent, "DESCRIPTOR"):     # a repeated message field: its first element
            if not len(parent):
                return
            parent = parent[0]
    if not field.is_repeated:
        setattr(parent, path[-1], value)
        return
    target = getattr(parent, path[-1])
    if is_map(field):
        target.clear()
        target.update(value)
        return
    if field.type == F.TYPE_MESSAGE:        # value: how many copies of its first element the list gets
        value = [copy.deepcopy(target[0])] * value if len(target) else []
    del target[:]
    target.extend(value)


def mutate(draw, request) -> None:
    """Sets one or two of request's fields, at any depth, to extremes (draw: a composite strategy's)."""
    paths = [p for p in field_paths(request) for _ in range(weight(p[1]))]
    chosen = draw(st.lists(st.sampled_from(paths), min_size=1, max_size=2, unique_by=lambda p: p[0]))
    for path, field in sorted(chosen, key=lambda p: -len(p[0])):    # inside a list's element before the list
        set_path(request, path, field, draw(extreme(field)))
