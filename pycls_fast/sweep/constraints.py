"""Constraints on a sweep's samples: complexity ranges (pycls's SETUP.CONSTRAINTS.CX)
and expressions over config keys and complexity (SETUP.CONSTRAINTS.EXPRS), e.g.

    CX: {FLOPS: [0, 2.0e+8]}                 # [LOW, HIGH]; 0 leaves that end open
    EXPRS: ["VIT.MLP_DIM >= 2 * VIT.HIDDEN_DIM", "params < 5e6"]

An expression is Python arithmetic, comparisons, and/or/not and min/max/abs over
dotted config keys and the names flops, params, acts; nothing else is evaluated.
"""

import ast
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from yacs.config import CfgNode

from pycls_fast.errors import ConfigError

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_COMPARE = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}  # fmt: skip
_FUNCTIONS = {"min": min, "max": max, "abs": abs, "len": len}
COMPLEXITY_NAMES = ("flops", "params", "acts")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _value(cfg: CfgNode, cx: Mapping[str, float], name: str) -> Any:
    if name in cx:
        return cx[name]
    node: Any = cfg
    for part in name.split("."):
        if not isinstance(node, CfgNode) or part not in node:
            raise ConfigError(f"constraint names {name}, which is not a config key")
        node = node[part]
    return node


def _eval(node: ast.AST, cfg: CfgNode, cx: Mapping[str, float]) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body, cfg, cx)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_eval(e, cfg, cx) for e in node.elts]
    name = _dotted(node)
    if name is not None:
        return _value(cfg, cx, name)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](
            _eval(node.left, cfg, cx), _eval(node.right, cfg, cx)
        )
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
        v = _eval(node.operand, cfg, cx)
        return (not v) if isinstance(node.op, ast.Not) else -v
    if isinstance(node, ast.BoolOp):
        values = (_eval(v, cfg, cx) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and all(type(o) in _COMPARE for o in node.ops):
        left = _eval(node.left, cfg, cx)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _eval(right_node, cfg, cx)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*(_eval(a, cfg, cx) for a in node.args))
    raise ConfigError(f"constraint uses {ast.dump(node)[:60]}, which is not allowed")


def parse_expr(text: str) -> ast.Expression:
    """Parses a constraint expression; ConfigError when it is not valid Python."""
    try:
        return ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ConfigError(
            f"constraint {text!r} is not an expression: {e.msg}"
        ) from None


def evaluate(text: str, cfg: CfgNode, cx: Mapping[str, float]) -> Any:
    """The value of the constraint expression `text` for a config and its complexity."""
    try:
        return _eval(parse_expr(text), cfg, cx)
    except ConfigError as e:
        raise ConfigError(f"{e} (in {text!r})") from None
    except (TypeError, ZeroDivisionError) as e:
        raise ConfigError(f"constraint {text!r} cannot be evaluated: {e}") from None


def needs_complexity(
    cx_ranges: Mapping[str, Sequence[float]], exprs: Sequence[str]
) -> bool:
    """Whether checking these constraints needs the model's complexity."""
    if any(lo or hi for lo, hi in cx_ranges.values()):
        return True
    return any(
        isinstance(n, ast.Name) and n.id in COMPLEXITY_NAMES
        for e in exprs
        for n in ast.walk(parse_expr(e))
    )


def violation(
    cfg: CfgNode,
    cx: Mapping[str, float],
    cx_ranges: Mapping[str, Sequence[float]],
    exprs: Sequence[str],
) -> str | None:
    """Why a sample breaks the constraints (e.g. "flops > 2e+08"), or None."""
    for name, (lo, hi) in cx_ranges.items():
        value = cx[name.lower()]
        if lo and value < lo:
            return f"{name.lower()} < {lo:g}"
        if hi and value > hi:
            return f"{name.lower()} > {hi:g}"
    for text in exprs:
        if not evaluate(text, cfg, cx):
            return f"not {text}"
    return None
