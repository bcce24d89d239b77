"""A bounded least-recently-used cache for the call paths' per-signature plans, and what deriving them shares (no kernel
imports)."""
from __future__ import annotations

import weakref
from collections import OrderedDict


_ALL: list = []


def signature(*tensors) -> tuple:
    """What a per-signature plan is keyed on of each tensor: shape, strides, dtype and device (flattened)."""
    return tuple(x for t in tensors for x in (t.shape, t.stride(), t.dtype, t.device))


def layout(t) -> tuple:
    """(shape, strides, dtype) of an output a prepared call makes again each call (``torch.empty_strided``)."""
    return tuple(t.shape), tuple(t.stride()), t.dtype


def shallow_copy(obj):
    """``copy.copy`` of a plain object (its ``__dict__``), without the reduce protocol's cost: a growing cache's
    routes are derived per new count of keys, several copies a step."""
    other = object.__new__(type(obj))
    other.__dict__.update(obj.__dict__)
    return other


class Unchanged:
    """Whether tensors hold what they held when ``remember``ed: the same objects (weak references), at the same
    addresses, with the same version counters (every in-place write through torch bumps a tensor's version), so that
    what was computed from their values then still holds. Inference tensors keep no version: never remembered. Writes
    that bypass torch (a kernel given the raw address) are not seen; callers say so where they rely on this."""

    __slots__ = ("_state",)

    def __init__(self):
        self._state = None

    def remember(self, *tensors) -> None:
        if any(t.is_inference() for t in tensors):
            self._state = None
            return
        self._state = tuple((weakref.ref(t), t.data_ptr(), t._version) for t in tensors)

    def holds(self, *tensors) -> bool:
        state = self._state
        if state is None or len(state) != len(tensors):
            return False
        for (ref, ptr, version), t in zip(state, tensors):
            if ref() is not t or t.data_ptr() != ptr or t._version != version:
                return False
        return True


def clear_all() -> None:
    """Forget every route and prepared launch (after the tuning table changed: they hold its configs)."""
    for cache in _ALL:
        cache.clear()


class BoundedCache:
    """A least-recently-used mapping of at most ``maxsize`` entries: the per-call-signature plans of the call paths
    (a model's lengths change call by call, so a plan per length must not grow without bound)."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._d: OrderedDict = OrderedDict()
        _ALL.append(self)

    def get(self, key):
        value = self._d.get(key)
        if value is not None:
            self._d.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.maxsize:
            self._d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)
