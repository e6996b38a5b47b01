"""``tensorrt_plugin`` against a stand-in for ``tensorrt.plugin`` (the real one needs TensorRT and a GPU).

The stand-in enforces the signature rules of TensorRT's own validation (tensorrt/plugin/_validate.py: annotated
classes, impl ``(inputs, attrs, outputs, stream)``, aot_impl ``(inputs, attrs, outputs, tactic)`` with a return
annotation) and records the decorated functions, which are then called with fake tensor descriptors.
"""

from __future__ import annotations

import inspect
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import pytest

from trtbuild.plugins.paged_attention import tensorrt_plugin, triton_kernel

INPUTS = ["qkv", "key_cache", "value_cache", "positions", "block_tables", "query_start_loc", "cos_sin_cache"]


@dataclass(frozen=True)
class Expr:
    """A symbolic shape expression, kept as text."""

    text: str

    def __sub__(self, other: int) -> Expr:
        return Expr(f"({self.text} - {other})")

    def __floordiv__(self, other: int) -> Expr:
        return Expr(f"({self.text} // {other})")

    def __add__(self, other: Expr) -> Expr:
        return Expr(f"({self.text} + {other.text})")

    def __rmul__(self, other: int) -> Expr:
        return Expr(f"({other} * {self.text})")


class TensorDesc:
    def __init__(self, shape: tuple[Any, ...] = (), dtype: str = "DataType.FLOAT", alias_of: Any = None) -> None:
        self.shape_expr = [s if isinstance(s, Expr | int) else Expr(s) for s in shape]
        self.dtype = dtype
        self.alias_of = alias_of

    def aliased(self) -> TensorDesc:
        return TensorDesc(tuple(self.shape_expr), self.dtype, alias_of=self)


class Tensor:
    pass


@dataclass
class KernelLaunchParams:
    grid_x: Any = 1
    grid_y: Any = 1
    block_x: int = 1
    shared_mem: int = 0


class SymExprs(tuple):
    @classmethod
    def from_tuple(cls, items: list[Any]) -> SymExprs:
        return cls(items)


@dataclass(frozen=True)
class SymInt32:
    value: Any


@dataclass
class Registry:
    funcs: dict[str, dict[str, Any]] = field(default_factory=dict)


def fake_trtp(with_aot: bool) -> tuple[types.ModuleType, Registry]:
    reg = Registry()
    mod = types.ModuleType("tensorrt.plugin")

    def check(kind: str, fn: Any, tail: list[str]) -> None:
        sig = inspect.signature(fn)
        for name, p in sig.parameters.items():
            assert not isinstance(p.annotation, str), f"{kind}: annotation of {name} is a string"
        registered = reg.funcs.get(tensorrt_plugin.PLUGIN_ID, {}).get("register")
        attrs = [] if registered is None else list(inspect.signature(registered).parameters)[len(INPUTS) :]
        expected = INPUTS + (attrs if kind in ("impl", "aot_impl") else []) + tail
        assert list(sig.parameters) == expected, f"{kind}: {list(sig.parameters)} != {expected}"
        if kind == "aot_impl":
            ret = sig.return_annotation
            assert typing.get_origin(ret) is tuple and len(typing.get_args(ret)) == 4

    def decorator(kind: str, tail: list[str]) -> Any:
        def make(plugin_id: str) -> Any:
            def wrap(fn: Any) -> Any:
                if kind == "register":
                    params = inspect.signature(fn).parameters
                    assert list(params)[: len(INPUTS)] == INPUTS
                    assert all(params[n].annotation is TensorDesc for n in INPUTS)
                    assert all(params[n].annotation in (int, float) for n in list(params)[len(INPUTS) :])
                    assert typing.get_args(inspect.signature(fn).return_annotation) == (TensorDesc,) * 3
                else:
                    check(kind, fn, tail)
                reg.funcs.setdefault(plugin_id, {})[kind] = fn
                return fn

            return wrap

        return make

    mod.register = decorator("register", [])
    mod.autotune = decorator("autotune", ["outputs"])
    mod.impl = decorator("impl", ["outputs", "stream"])
    if with_aot:
        mod.aot_impl = decorator("aot_impl", ["outputs", "tactic"])
    mod.TensorDesc, mod.Tensor, mod.KernelLaunchParams = TensorDesc, Tensor, KernelLaunchParams
    mod.SymExprs, mod.SymIntExprs, mod.SymInt32 = SymExprs, SymExprs, SymInt32
    mod.AutoTuneCombination = lambda spec: ("combination", spec)
    mod.from_shape_expr = lambda shape, dtype: TensorDesc(tuple(shape), dtype)
    return mod, reg


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Registry:
    mod, reg = fake_trtp(with_aot=True)
    trt = types.ModuleType("tensorrt")
    trt.plugin = mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", mod)
    monkeypatch.setattr(tensorrt_plugin, "_state", dict(tensorrt_plugin._state, registered=False, aot=False))
    return reg


ATTRS = dict(
    num_heads=6, num_kv_heads=2, head_size=64, scale=0.125, rotary_interleaved=1, has_rope=1, sliding_window=0,
    softcap=0.0,
)  # fmt: skip


def descs(float_type: str = "DataType.HALF") -> list[TensorDesc]:
    return [
        TensorDesc(("T", 640), float_type),
        TensorDesc(("NB", 16, 2, 64), float_type),
        TensorDesc(("NB", 16, 2, 64), float_type),
        TensorDesc(("T",), "DataType.INT32"),
        TensorDesc(("B", "M"), "DataType.INT32"),
        TensorDesc(("B1",), "DataType.INT32"),
        TensorDesc((4096, 32), "DataType.FLOAT"),
    ]


def test_registration_shapes_and_aliasing(fake: Registry) -> None:
    assert tensorrt_plugin.register() is True
    assert tensorrt_plugin.register() is True  # idempotent
    funcs = fake.funcs[tensorrt_plugin.PLUGIN_ID]
    assert set(funcs) == {"register", "autotune", "impl", "aot_impl"}
    inputs = descs()
    out, k_out, v_out = funcs["register"](*inputs, **ATTRS)
    assert out.shape_expr == [Expr("T"), 6 * 64] and out.dtype == "DataType.HALF"
    assert k_out.alias_of is inputs[1] and v_out.alias_of is inputs[2]
    [(_, spec)] = funcs["autotune"](*inputs, outputs=(out, k_out, v_out))
    assert len(spec.split(",")) == len(INPUTS) + 3


def test_aot_impl_wires_the_compiled_kernel(fake: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def compile_ptx(attrs: Any, **kw: Any) -> triton_kernel.CompiledKernel:
        calls.append((attrs, kw))
        return triton_kernel.CompiledKernel("k", ".version 8.0", 128, 2048, kw["arch"], block_q=21)

    monkeypatch.setattr(triton_kernel, "compile_ptx", compile_ptx)
    tensorrt_plugin.register()
    tensorrt_plugin.configure_aot(80, ptx_version=85)
    inputs = descs()
    name, ptx, launch, extra = fake.funcs[tensorrt_plugin.PLUGIN_ID]["aot_impl"](*inputs, **ATTRS, outputs=(), tactic=0)
    assert (name, ptx) == (b"k", b".version 8.0")
    assert tensorrt_plugin.compiled_ptx_isa() == "8.0"  # recorded in the engine's manifest entry
    attrs, kw = calls[0]
    assert (attrs.num_heads, attrs.num_kv_heads, attrs.head_size, attrs.scale, attrs.rotary_interleaved) == (
        6,
        2,
        64,
        0.125,
        True,
    )
    assert (attrs.sliding_window, attrs.softcap) == (None, None)  # fields 0: the attributes are absent
    assert kw == dict(has_rope=True, arch=80, float_type="fp16", index_type="i32", cos_sin_type="fp32", ptx_version=85)
    grid = (launch.grid_x, launch.grid_y, launch.block_x, launch.shared_mem)
    assert grid == (Expr("((T // 21) + (B1 - 1))"), 2, 128, 2048)  # query tiles of 21 tokens, kv heads
    # the kernel's scalars: num_tokens, num_seqs, max_blocks, num_blocks, block_size, rotary dim, rotary rows
    assert [s.value for s in extra] == [Expr("T"), Expr("(B1 - 1)"), Expr("M"), Expr("NB"), 16, 32, 4096]
    no_rope = dict(ATTRS, has_rope=0)
    *_, extra = fake.funcs[tensorrt_plugin.PLUGIN_ID]["aot_impl"](*inputs, **no_rope, outputs=(), tactic=0)
    assert [s.value for s in extra[-2:]] == [0, 1]
    windowed = dict(ATTRS, sliding_window=4096, softcap=50.0)
    fake.funcs[tensorrt_plugin.PLUGIN_ID]["aot_impl"](*inputs, **windowed, outputs=(), tactic=0)
    assert (calls[-1][0].sliding_window, calls[-1][0].softcap) == (4096, 50.0)


def test_without_aot_support_only_jit_is_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    mod, reg = fake_trtp(with_aot=False)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", mod)
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    monkeypatch.setattr(tensorrt_plugin, "_state", dict(tensorrt_plugin._state, registered=False, aot=False))
    assert tensorrt_plugin.register() is False
    assert set(reg.funcs[tensorrt_plugin.PLUGIN_ID]) == {"register", "autotune", "impl"}


def test_plugin_module_imports_without_tensorrt_or_triton() -> None:
    source = inspect.getsource(tensorrt_plugin)
    assert "\nimport tensorrt" not in source and "\nfrom .triton_kernel" not in source
    assert "from __future__ import annotations" not in source  # tensorrt.plugin inspects real annotation classes
