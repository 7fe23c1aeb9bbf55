"""Test-only workarounds that let Triton 3.9's interpreter (``TRITON_INTERPRET=1``) run flash-linear-attention 0.6.0.

The interpret lane (``pytest -m interpret``) runs our fla code paths on CPU tensors: every Triton kernel is executed
by ``triton.runtime.interpreter`` with numpy underneath. Out of the box that fails or gives wrong numbers for the
reasons below; ``install()`` patches each one (idempotent; it must run before the first kernel launch, because the
interpreter caches the rewritten kernels). Nothing here is imported by the package, and nothing changes what a GPU
run does. The patches are written against the pinned versions (``PINNED``); ``tests/conftest.py`` refuses to run the
lane on any other version rather than skip it, since a patch that silently stops applying would make the lane lie.

1. Autotuner. Symptom: ``RuntimeError: 0 active drivers ([]). There should only be one.`` from
   ``runtime/autotuner.py``, which benchmarks every config when a kernel has several. Fix: keep the first config
   (any config computes the same result; only the speed differs).
2. ``range`` loop variables. Symptom: ``AttributeError: 'int' object has no attribute 'to'`` in fla's
   ``ops/common/chunk_delta_h.py`` (``i_t.to(tl.int64)``): the interpreter's AST rewrite turns assigned values into
   tensors but leaves a ``for ... in range(...)`` variable a Python int. Fix: a ``visit_For`` that rebinds the loop
   variable through the same ``to_tensor`` at the top of the body.
3. bfloat16 arithmetic. The interpreter stores bf16 as its raw uint16 bits and hands those bits to numpy. Symptoms:
   ``tl.dot`` of bf16 tiles gives outputs around 1e9; binary ops give NaN; unary ops (exp, log, ...) give gradients
   off by ~1e3; sum reductions / cumsums give a GDN gate gradient off by ~265, only once a segment spans 3+ chunks of
   64; max / min compare bit patterns (wrong for negative numbers). Fix: decode the bits to fp32, compute, and round
   back to bf16 (nearest even) where the result is bf16.
4. fp32 -> bf16 casts. Symptom: fla's bf16 GDN output is ~1.5% too small in magnitude (relative error vs our torch
   backend 1.8e-2 instead of 6.6e-3): the interpreter truncates the mantissa where a GPU rounds to nearest even.
   Fix: round to nearest even.
"""

from __future__ import annotations

import ast
import importlib.metadata

import numpy as np

PINNED = {"triton": "3.9.0", "flash-linear-attention": "0.6.0", "fla-core": "0.6.0"}
"""The versions these workarounds are written and checked against (the ``interpret`` extra pins the same)."""

_INSTALLED = False


def version_mismatches() -> list[str]:
    """``"name: installed X, pinned Y"`` for each pinned distribution whose installed version differs (or is absent)."""
    out = []
    for name, pinned in PINNED.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "absent"
        if installed != pinned:
            out.append(f"{name}: installed {installed}, pinned {pinned}")
    return out


def install() -> None:
    """Apply the four workarounds of the module docstring (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from triton.runtime import autotuner, interpreter

    _keep_first_autotune_config(autotuner.Autotuner)
    interpreter.ASTTransformer.visit_For = _visit_for
    _patch_bf16(interpreter)
    _INSTALLED = True


# ------------------------------------------------------------------------------------------------ 1. autotuner


def _keep_first_autotune_config(autotuner_cls) -> None:
    run = autotuner_cls.run

    def run_first_config(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    autotuner_cls.run = run_first_config


# ------------------------------------------------------------------------------------------ 2. range loop variables


def _is_range_call(node: ast.expr) -> bool:
    """``range(...)`` or ``tl.range(...)`` (``tl.static_range`` stays a Python int: it is unrolled)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "range") or (
        isinstance(func, ast.Attribute) and func.attr == "range"
    )


def _visit_for(self, node: ast.For) -> ast.For:
    node = self.generic_visit(node)
    if isinstance(node.target, ast.Name) and _is_range_call(node.iter):
        name = node.target.id
        # name = interpreter_semantic.to_tensor(name, False): what the interpreter's visit_Assign makes of an assignment
        rebind = ast.Assign(
            targets=[ast.Name(id=name, ctx=ast.Store())],
            value=ast.Call(
                func=ast.Attribute(
                    value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor", ctx=ast.Load()
                ),
                args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)],
                keywords=[],
            ),
        )
        node.body.insert(0, ast.copy_location(rebind, node))
    return node


# ---------------------------------------------------------------------------------------------- 3, 4. bfloat16


def bf16_bits_to_fp32(bits) -> np.ndarray:
    """bf16 stored as uint16 bits -> the fp32 values they encode (exact)."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def fp32_to_bf16_bits(values) -> np.ndarray:
    """fp32 values -> bf16 uint16 bits, rounded to nearest even like a GPU (NaN stays NaN)."""
    x = np.asarray(values, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _patch_bf16(interp) -> None:
    import triton.language as tl

    builder, reduce_ops, scan_ops, handle_cls = (
        interp.InterpreterBuilder,
        interp.ReduceOps,
        interp.ScanOps,
        interp.TensorHandle,
    )

    def is_bf16(h) -> bool:
        return h.dtype.scalar == tl.bfloat16

    def back(result, dtype):
        """A result computed in fp32 from bf16 operands: bf16 bits again if it is a float, as it is otherwise."""
        result = np.asarray(result)
        return handle_cls(fp32_to_bf16_bits(result) if result.dtype.kind == "f" else result, dtype)

    binary_op, unary_op, create_dot, cast_impl = (
        builder.binary_op,
        builder.unary_op,
        builder.create_dot,
        builder.cast_impl,
    )
    create_fp_to_fp, create_rsqrt, create_fma = builder.create_fp_to_fp, builder.create_rsqrt, builder.create_fma

    def bf16_binary_op(self, lhs, rhs, op):
        if not (is_bf16(lhs) and is_bf16(rhs)):
            return binary_op(self, lhs, rhs, op)
        return back(op(bf16_bits_to_fp32(lhs.data), bf16_bits_to_fp32(rhs.data)), lhs.dtype.scalar)

    def bf16_unary_op(self, arg, op):
        if not is_bf16(arg):
            return unary_op(self, arg, op)
        return back(op(bf16_bits_to_fp32(arg.data)), arg.dtype.scalar)

    def bf16_rsqrt(self, arg):
        if not is_bf16(arg):
            return create_rsqrt(self, arg)
        return back(1 / np.sqrt(bf16_bits_to_fp32(arg.data)), arg.dtype.scalar)

    def bf16_fma(self, x, y, z):
        if not any(is_bf16(h) for h in (x, y, z)):
            return create_fma(self, x, y, z)
        f32 = [bf16_bits_to_fp32(h.data) if is_bf16(h) else h.data for h in (x, y, z)]
        result = np.add(np.multiply(f32[0], f32[1], dtype=np.float64), f32[2], dtype=np.float64)
        return back(result.astype(np.float32), z.dtype.scalar) if is_bf16(z) else handle_cls(result, z.dtype.scalar)

    def bf16_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (is_bf16(a) or is_bf16(b) or is_bf16(d)):
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a32, b32, d32 = (bf16_bits_to_fp32(h.data) if is_bf16(h) else h.data for h in (a, b, d))
        result = np.matmul(a32, b32, dtype=np.float32) + d32
        return back(result, d.dtype.scalar) if is_bf16(d) else handle_cls(result.astype(d.data.dtype), d.dtype.scalar)

    def rne_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle_cls(fp32_to_bf16_bits(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def rne_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle_cls(fp32_to_bf16_bits(src.data), dst_type.scalar)
        return create_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.binary_op, builder.unary_op, builder.create_dot = bf16_binary_op, bf16_unary_op, bf16_dot
    builder.create_rsqrt, builder.create_fma = bf16_rsqrt, bf16_fma
    builder.cast_impl, builder.create_fp_to_fp = rne_cast, rne_fp_to_fp
    _patch_bf16_reductions(reduce_ops, scan_ops, tl)


def _patch_bf16_reductions(reduce_ops, scan_ops, tl) -> None:
    """Sums, cumsums / cumprods and max / min of bf16 tiles in fp32 (one rounding at the end, like a GPU's fp32
    accumulator); max / min on the raw bits would order negative numbers backwards."""
    reduce_sum, min_max = reduce_ops.sum, reduce_ops.min_max
    cumsum, cumprod = scan_ops.cumsum, scan_ops.cumprod

    def decoded(t):
        return bf16_bits_to_fp32(t.handle.data)

    def bf16_sum(self, input):
        if input.dtype.scalar != tl.bfloat16:
            return reduce_sum(self, input)
        total = np.sum(decoded(input), axis=self.axis, keepdims=self.keep_dims, dtype=np.float32)
        return self.to_tensor(fp32_to_bf16_bits(total), input.dtype)

    def bf16_min_max(self, input, val_reduce_op, idx_reduce_op=None):
        value = input[0] if isinstance(input, tuple) else input
        if value.dtype.scalar != tl.bfloat16:
            return min_max(self, input, val_reduce_op, idx_reduce_op)
        val = idx = None
        if val_reduce_op:
            picked = val_reduce_op(decoded(value), axis=self.axis, keepdims=self.keep_dims)
            val = self.to_tensor(fp32_to_bf16_bits(picked), value.dtype)
        if idx_reduce_op:
            idx = self.to_tensor(idx_reduce_op(decoded(value), axis=self.axis, keepdims=self.keep_dims), tl.int32)
        if val is not None and idx is not None:
            return val, idx
        return val if val is not None else idx

    def scan(original, np_op):
        def bf16_scan(self, input):
            if input.dtype.scalar != tl.bfloat16:
                return original(self, input)
            result = np_op(decoded(input), axis=self.axis, dtype=np.float32)
            return [self.to_tensor(fp32_to_bf16_bits(result), dtype=input.dtype)]

        return bf16_scan

    reduce_ops.sum, reduce_ops.min_max = bf16_sum, bf16_min_max
    scan_ops.cumsum, scan_ops.cumprod = scan(cumsum, np.cumsum), scan(cumprod, np.cumprod)


__all__ = ["PINNED", "bf16_bits_to_fp32", "fp32_to_bf16_bits", "install", "version_mismatches"]
