"""Tensor subclasses in torch.save pickles (torchao's ``Float8Tensor``, ``Int8Tensor``, ``NF4Tensor``
…), named and described without running their code.

torch pickles a wrapper subclass as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, cls,
(cls, dtype, size, stride, offset, layout, device, requires_grad), state)``: the outer tensor's
dtype and shape, then the instance ``__dict__`` -- its inner tensors (``qdata``, ``scale``,
``zero_point``…, plain tensors) beside plain attributes and a few of the package's own values
(torchao's ``KernelPreference`` enum). torch's ``weights_only`` loader admits them once the package
registers them as safe globals; here, without trust, a global of a known subclass package resolves
to a :class:`ForeignRecord` type that only keeps its arguments, and :func:`check_contained` refuses
the pickle (as "could run code", as before) when one is used anywhere but inside such a tensor.
A :class:`SubclassRef` keeps the description (an :class:`UnreadableRef`: listed under its name,
refused where its value is asked for). Under trust the class is the real one
(:meth:`SubclassRef.dequantize` builds it as torch would, and calls its ``dequantize()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..dtypes import DType
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from .dtensor import Record
from .refs import TensorRef

if TYPE_CHECKING:
    import torch

__all__ = [
    "SUBCLASS_PACKAGES",
    "ForeignNames",
    "ForeignRecord",
    "SubclassRef",
    "UnreadableRef",
    "check_contained",
    "class_name",
]

SUBCLASS_PACKAGES = ("torchao",)
_MAX_INNER = 64


class ForeignRecord(Record):
    """A global of a subclass package named in an untrusted pickle (a class, an enum): its
    arguments and state, kept as data."""


def class_name(cls: Any) -> str:
    if isinstance(cls, type) and issubclass(cls, ForeignRecord):
        return cls.torch_name
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', type(cls).__name__)}"[:160]


class ForeignNames:
    """The foreign record types one unpickling handed out (one type per global named)."""

    def __init__(self) -> None:
        self.types: dict[tuple[str, str], type[ForeignRecord]] = {}

    @staticmethod
    def admits(module: str) -> bool:
        return module.split(".", 1)[0] in SUBCLASS_PACKAGES

    def resolve(self, module: str, name: str) -> type[ForeignRecord]:
        found = self.types.get((module, name))
        if found is None:
            attrs = {"__module__": __name__, "torch_name": f"{module}.{name}"}
            found = self.types[(module, name)] = type(name[:80] or "_", (ForeignRecord,), attrs)
        return found


def _foreign(obj: Any) -> str | None:
    if isinstance(obj, type) and issubclass(obj, ForeignRecord):
        return obj.torch_name
    if isinstance(obj, ForeignRecord):
        return obj.torch_name
    return None


def check_contained(obj: Any) -> str | None:
    """The name of a foreign record that lies anywhere in ``obj`` outside a :class:`SubclassRef`
    (torch's loader would build that object, which can run code: the caller refuses it), else None."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        v = stack.pop()
        if id(v) in seen or isinstance(v, (SubclassRef, str, bytes, int, float, TensorRef)):
            continue
        seen.add(id(v))
        what = _foreign(v)
        if what is not None:
            return what
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif isinstance(v, Record):
            stack.extend(v.args)
            stack.extend(v.fields.values())
    return None


def _shape(t: Any) -> str:
    if isinstance(t, SubclassRef):
        return f"{t.dtype.name} {list(t.shape)} ({t.kind})"
    return f"{t.dtype.name} {list(t.shape)}"


class UnreadableRef:
    """A tensor of a kind DCP Studio cannot read (sparse, quantized, nested, a subclass): kept under
    its name so the rest of the file opens, and refused with ``reason`` where its value is asked for."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __reduce__(self) -> Any:
        raise UnsupportedFormatError(f"holds {self.reason}")

    def __repr__(self) -> str:
        return f"<{self.reason.split(';')[0]}>"


class SubclassRef(UnreadableRef):
    """A tensor subclass as its pickle describes it: class, outer ``dtype``/``shape``, its inner
    tensors (``inner``: name -> :class:`TensorRef` or nested :class:`SubclassRef`, in pickle order)
    and other attributes. ``cls`` is the real class when the pickle was trusted, else None."""

    __slots__ = ("attrs", "cls", "dtype", "inner", "kind", "requires_grad", "shape", "stride")

    def __init__(self, cls: Any, dtype: Any, shape: Any, stride: Any, requires_grad: Any) -> None:
        if not isinstance(dtype, DType):
            raise CorruptCheckpointError(f"tensor subclass with element type {dtype!r}")
        probe = TensorRef(None, dtype, shape, stride)  # checks size and stride
        self.cls = None if isinstance(cls, type) and issubclass(cls, ForeignRecord) else cls
        name = class_name(cls)
        package, _, _ = name.partition(".")
        self.kind = f"{package} {name.rsplit('.', 1)[-1]}"
        self.dtype, self.shape, self.stride = dtype, probe.shape, probe.stride
        self.requires_grad = bool(requires_grad)
        self.inner: dict[str, TensorRef | SubclassRef] = {}
        self.attrs: dict[str, Any] = {}
        super().__init__("")

    def __setstate__(self, state: Any) -> None:
        """The instance ``__dict__`` torch pickles (or ``(dict, slots)``)."""
        parts = [s for s in state if s is not None] if isinstance(state, tuple) and len(state) == 2 else [state]
        for part in parts:
            if not isinstance(part, dict):
                raise CorruptCheckpointError(f"damaged {self.kind} state in pickle")
            for key, value in part.items():
                if not isinstance(key, str):
                    raise CorruptCheckpointError(f"damaged {self.kind} state in pickle")
                if isinstance(value, (TensorRef, SubclassRef)):
                    self.inner[key] = value
                else:
                    self.attrs[key] = value
        if not self.inner or len(self.inner) > _MAX_INNER:
            raise CorruptCheckpointError(f"a {self.kind} with {len(self.inner)} inner tensors")
        inner = ", ".join(f"{k} {_shape(t)}" for k, t in self.inner.items())
        self.reason = f"a {self.kind} (a tensor subclass: {inner})"

    def tensors(self, prefix: str = "") -> list[tuple[str, TensorRef]]:
        """The plain tensors it holds, named ``qdata``, ``scale``… (``inner.qdata`` when nested)."""
        out: list[tuple[str, TensorRef]] = []
        for key, t in self.inner.items():
            if isinstance(t, SubclassRef):
                out.extend(t.tensors(f"{prefix}{key}."))
            else:
                out.append((prefix + key, t))
        return out

    def advice(self, fqn: str) -> str:
        names = ", ".join(repr(f"{fqn}.{k}") for k, _ in self.tensors()[:4])
        return (
            f"{self.reason}; with --trust-pickle (and {self.kind.split()[0]} installed) its inner tensors convert "
            f"as {names}, or with --dequantize as {self.dtype.name} {list(self.shape)}; or leave it out with --exclude"
        )

    def build(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The real subclass instance, as torch's loader builds it (trusted pickles only): the
        wrapper, then its state with the inner tensors' values (``values``, by :meth:`tensors` name)."""
        import torch

        if self.cls is None:
            raise UnsupportedFormatError(f"{self.reason}; pass --trust-pickle to build it")
        state: dict[str, Any] = dict(self.attrs)
        for key, t in self.inner.items():
            if isinstance(t, SubclassRef):
                sub = {k.removeprefix(key + "."): v for k, v in values.items() if k.startswith(key + ".")}
                state[key] = t.build(sub)
            else:
                state[key] = values[key]
        out = torch._utils._rebuild_wrapper_subclass(
            self.cls, self.dtype.torch, self.shape, self.stride, 0, torch.strided, torch.device("cpu"),
            self.requires_grad,
        )  # fmt: skip
        torch._utils._set_obj_state(out, state)
        return out

    def dequantize(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tensor's own ``dequantize()`` (trusted: its code runs), checked to be the outer dtype and shape."""
        obj = self.build(values)
        method = getattr(obj, "dequantize", None)
        if method is None:
            raise UnsupportedFormatError(f"{self.reason}: it has no dequantize()")
        out = method()
        if type(out).__name__ != "Tensor" or tuple(out.shape) != self.shape:
            raise UnsupportedFormatError(f"{self.reason}: its dequantize() gave {type(out).__name__} {list(out.shape)}")
        return out.to(self.dtype.torch).contiguous()

    def __repr__(self) -> str:
        return f"<{self.reason}>"
