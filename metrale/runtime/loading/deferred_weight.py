"""A 2-D checkpoint weight kept in a quantized form (GGUF blocks, FP8) that stands in for its dequantized float32
tensor wherever model code treats it as one: any torch function, method or operator on it works on dequantize()'s
tensor, except the few a subclass keeps in its own form (joined(): torch.cat of its kind along rows; stacked():
torch.stack of its kind, a mixture's experts), so a backend that multiplies the form itself gets it at upload."""

from abc import ABC, abstractmethod

import torch


class DeferredWeight(ABC):
    """shape [rows, columns]; a subclass gives dequantize() -> float32, and where its form can stack rows, joins()
    (whether torch.cat along rows keeps self and another in the form) and the classmethod joined(weights) (the
    rows of weights that each join the first, in order)."""

    dtype = torch.float32
    OWN = ("shape",)          # attributes a subclass sets: never looked up on the dequantized tensor

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float32 tensor the weight stands for."""

    def joins(self, other: "DeferredWeight") -> bool:
        return False

    @classmethod
    def stacked(cls, weights: list["DeferredWeight"]):
        """torch.stack of weights that each join the first, in a form of the subclass's; None: dequantized."""
        return None

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return self.shape[0]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat or func is torch.stack:
            kept = (_joined if func is torch.cat else _stacked)(*args, **kwargs)
            if kept is not None:
                return kept
        return func(*dequantized(args), **dequantized(kwargs))

    def __getattr__(self, name: str):
        # Tensor methods and attributes (.float(), .to(), .contiguous(), .T) on the dequantized tensor.
        if name.startswith("__") or name in type(self).OWN:
            raise AttributeError(name)
        return getattr(self.dequantize(), name)

    def __getitem__(self, index):
        return self.dequantize()[index]

    def __neg__(self):
        return -self.dequantize()

    def __add__(self, other):
        return self.dequantize() + dequantized(other)

    def __radd__(self, other):
        return dequantized(other) + self.dequantize()

    def __sub__(self, other):
        return self.dequantize() - dequantized(other)

    def __rsub__(self, other):
        return dequantized(other) - self.dequantize()

    def __mul__(self, other):
        return self.dequantize() * dequantized(other)

    def __rmul__(self, other):
        return dequantized(other) * self.dequantize()

    def __truediv__(self, other):
        return self.dequantize() / dequantized(other)

    def __matmul__(self, other):
        return self.dequantize() @ dequantized(other)

    def __rmatmul__(self, other):
        return dequantized(other) @ self.dequantize()


def _joined(tensors, dim: int = 0, **out):
    """torch.cat(tensors, dim) in the weights' own form, where it stacks rows of weights that join; else None."""
    tensors = list(tensors)
    first = tensors[0] if tensors else None
    if dim not in (0, -2) or out or not isinstance(first, DeferredWeight):
        return None
    if not all(isinstance(w, type(first)) and first.joins(w) for w in tensors):
        return None
    return type(first).joined(tensors)


def _stacked(tensors, dim: int = 0, **out):
    """torch.stack(tensors, dim) in the weights' own form (stacked()), where the weights join; else None."""
    tensors = list(tensors)
    first = tensors[0] if tensors else None
    if dim != 0 or out or not isinstance(first, DeferredWeight):
        return None
    if not all(isinstance(w, type(first)) and first.joins(w) and w.shape == first.shape for w in tensors):
        return None
    return type(first).stacked(tensors)


def dequantized(value):
    """value with every DeferredWeight in it (in lists, tuples and dicts too) dequantized."""
    if isinstance(value, DeferredWeight):
        return value.dequantize()
    if type(value) in (list, tuple):
        return type(value)(dequantized(item) for item in value)
    if isinstance(value, dict):
        return {key: dequantized(item) for key, item in value.items()}
    return value
