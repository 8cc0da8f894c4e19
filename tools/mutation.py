"""Mutation testing of the core modules: plants one small defect at a time in a copy
of the repository and runs the fast tests that cover the module; a mutant that no
test notices is a defect the suite would let through (docs/RELIABILITY.md).

    python tools/mutation.py                 # a seeded sample of 6 per module
    python tools/mutation.py --all           # every mutant (hours on 2 cores)
    python tools/mutation.py --module ema --list

The mutations: comparisons flipped (== and !=, < and >=, ...) and moved across their
boundary (< and <=), + and -, * and /, `and` and `or`, a condition negated, a `not`
removed, integer and float constants changed (0 and 1, n to n + 1), True and False
swapped, a statement dropped (a call, an augmented assignment, an assignment to an
attribute or item, a return, a break or continue). Logging calls, error messages and
annotations are left alone. Results: out/mutation/results.json and report.md.
"""

import ast
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from pycls_fast.launch.cli import ArgumentParser, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Target:
    """A module to mutate, the tests that cover it (pytest node ids, fastest first:
    the run stops at the first failure) and, optionally, the only functions or
    classes to mutate (qualified names; a class covers its methods)."""

    name: str
    path: str
    tests: tuple[str, ...]
    only: tuple[str, ...] = ()


UNIT = "tests/unit"
COMPONENTS = f"{UNIT}/components/test_components.py"
SCALER = f"{UNIT}/components/test_loss_scaler.py"
GRAD_ACCUM = f"{UNIT}/engine/test_grad_accum.py"
TRAINER = f"{UNIT}/engine/test_trainer.py"
MANAGER = f"{UNIT}/checkpoint/test_manager.py"
TP_PLAN = f"{UNIT}/parallel/test_tensor_parallel_plan.py"
FILES = f"{UNIT}/checkpoint/test_files.py"
DATA_PARALLEL = f"{UNIT}/parallel/test_data_parallel.py"
PP_OVERFLOW = (
    "tests/integration/test_pipeline_parallel.py::"
    "test_an_fp16_overflow_in_one_stage_skips_the_step_in_all"
)
RESUME = f"{TRAINER}::test_resume_with_ema_ends_identical"
OVERFLOW = f"{COMPONENTS}::test_fp16_overflow_step_is_skipped_without_touching_weights"
O2 = f"{COMPONENTS}::test_o2_keeps_fp32_master_weights_and_fp32_layer_norm"

TARGETS = (
    Target(
        "precision",
        "pycls_fast/components/precision.py",
        (
            SCALER,
            f"{COMPONENTS}::test_o3_is_all_half",
            f"{COMPONENTS}::test_mixed_precision_flag_maps_to_o1",
            f"{COMPONENTS}::test_describe_precision",
            f"{COMPONENTS}::test_backend_flags_follow_the_config",
            O2,
            OVERFLOW,
            PP_OVERFLOW,  # the overflow flag's all-reduce over the ranks
        ),
    ),
    Target(
        "optimizer",
        "pycls_fast/components/optimizer.py",
        (
            f"{COMPONENTS}::test_lr_policies_and_warmup",
            f"{COMPONENTS}::"
            "test_a_warmup_as_long_as_the_run_is_warned_with_the_lr_it_reaches",
            f"{COMPONENTS}::test_weight_decay_groups_follow_pycls",
            f"{COMPONENTS}::test_fused_or_foreach_is_chosen_at_construction",
            f"{COMPONENTS}::"
            "test_optimizer_names_build_torchs_classes_with_the_configs_values",
            f"{COMPONENTS}::test_mta_and_loop_optimizers_agree",
            f"{COMPONENTS}::test_frozen_parameters_join_no_group_and_stay_as_they_are",
            f"{COMPONENTS}::test_mta_on_fsdp_shards_steps_as_the_loop",
            f"{UNIT}/components/test_layer_decay.py",
            f"{COMPONENTS}::test_timm_optimizers_keep_our_parameter_groups_and_train",
        ),
    ),
    Target(
        "ema",
        "pycls_fast/components/ema.py",
        (
            f"{COMPONENTS}::test_ema_follows_pycls_rule",
            f"{TRAINER}::test_ema_updates_every_period_with_pycls_alpha",
        ),
    ),
    Target(
        "checkpoint manager",
        "pycls_fast/checkpoint/manager.py",
        (
            f"{MANAGER}::test_epoch_cadence_saves_every_period_and_the_last_epoch",
            f"{MANAGER}::test_iteration_cadence",
            f"{MANAGER}::test_stop_saves_where_training_is",
            f"{MANAGER}::test_keep_best_points_at_the_lowest_test_error",
            f"{MANAGER}::test_a_save_keeps_the_best_unless_it_writes_over_it",
            RESUME,
        ),
    ),
    Target(
        "checkpoint files",
        "pycls_fast/checkpoint/files.py",
        (
            f"{MANAGER}::test_retention_keeps_the_last_k_the_newest_and_the_protected",
            f"{MANAGER}::test_keep_best_points_at_the_lowest_test_error",
            FILES,
            RESUME,
        ),
    ),
    Target(
        "checkpoint sharded",
        "pycls_fast/checkpoint/sharded.py",
        (
            FILES,
            f"{UNIT}/parallel/test_materialize.py::"
            "test_sharded_checkpoint_weights_are_read_one_tensor_at_a_time",
            f"{RESUME}[fsdp]",
        ),
    ),
    Target(
        "data parallel",
        "pycls_fast/parallel/data_parallel.py",
        (DATA_PARALLEL, O2, f"{RESUME}[fsdp]"),
    ),
    Target(
        "trainer step",
        "pycls_fast/engine/step.py",
        (
            f"{GRAD_ACCUM}::test_an_uneven_batch_weighs_each_image_alike",
            f"{TRAINER}::test_a_step_weighted_zero_leaves_the_weights",
            OVERFLOW,
            O2,
            f"{UNIT}/engine/test_distill.py::test_a_step_with_a_teacher_trains_both_heads",
            f"{GRAD_ACCUM}::test_micro_batches_give_the_whole_batch_step[ce-True]",
            f"{GRAD_ACCUM}::test_micro_batches_under_fsdp_give_the_whole_batch_step",
            PP_OVERFLOW,
        ),
        only=("train_step", "forward_backward", "mean_logits", "_gradient_sync"),
    ),
    Target(
        "tensor parallel",
        "pycls_fast/parallel/tensor_parallel.py",
        (
            TP_PLAN,
            "tests/integration/test_tensor_parallel.py::"
            "test_tp2_trains_as_one_process_fp32[tp-sp]",
        ),
    ),
)

# Mutants judged equivalent (no behaviour changes), by key (see Mutant.key), with
# the reason; they count apart from the survivors in the report.
EQUIVALENT: dict[str, str] = {
    "pycls_fast/checkpoint/files.py:safe_load:unary0:-1": (
        "torch's 'Unsupported global' line always reads 'GLOBAL <name>', so the "
        "split has two parts and [1] is [-1]"
    ),
    "pycls_fast/components/ema.py:ema_enabled:compare1:"
    "cfg.OPTIM.EMA_UPDATE_PERIOD > 0": "config.py accepts only EMA_UPDATE_PERIOD > 0 "
    "(gt=0), so `>= 0` holds exactly when `> 0` does",
    "pycls_fast/engine/step.py:forward_backward:negate0:if len(chunks) > 1:": (
        "the reduction is then on for every micro-batch instead of the last only: "
        "the sum of the reduced gradients is the reduced sum (more communication, "
        "the same step up to rounding)"
    ),
    "pycls_fast/engine/step.py:forward_backward:drop0:"
    "_gradient_sync(parts.trained, last)": (
        "the reduction then stays on for every micro-batch: the sum of the reduced "
        "gradients is the reduced sum (more communication, the same step up to "
        "rounding), as for the negated condition above it"
    ),
    "pycls_fast/engine/step.py:_gradient_sync:drop0:"
    "model.set_requires_gradient_sync(enabled)": (
        "FSDP2 then reduces the gradients after every micro-batch instead of the "
        "last only: the sum of the reduced gradients is the reduced sum (more "
        "communication, the same step up to rounding), as for the negated "
        "condition in forward_backward"
    ),
    "pycls_fast/engine/step.py:train_step:constant0:True": (
        "zero_grad(set_to_none=False) zeroes the grads in place of dropping them: "
        "every trained parameter gets a new gradient in every step, so the "
        "optimizer sees the same values (only memory differs)"
    ),
    "pycls_fast/checkpoint/files.py:safe_load:drop0:break": (
        "without the break the loop keeps the last 'Unsupported global' line, not "
        "the first: torch's message has one such line (it stops at the first "
        "global it refuses)"
    ),
    "pycls_fast/checkpoint/sharded.py:publish:drop0:distributed.barrier()": (
        "dcp.save and async_save end with an all-reduce whose result rank 0 "
        "broadcasts after writing .metadata (torch's _DistWrapper.all_reduce): no "
        "rank returns before every shard and the metadata are on disk, so the "
        "barrier that says so again is redundant"
    ),
    "pycls_fast/checkpoint/sharded.py:load:negate0:if 'ema' in whole:": (
        "dcp.load fills the EMA's own parameter tensors in place "
        "(get_model_state_dict returns them, not copies): setting them again "
        "changes nothing"
    ),
}

# Calls whose statements are not dropped and whose arguments are not mutated: logs
# and messages (a wrong log line is not what these tests are for).
_QUIET_CALLS = {"logger", "logging", "warnings", "print"}
_SKIPPED_FIELDS = {"returns", "annotation", "decorator_list", "type_comment"}

_COMPARE = {
    ast.Eq: [ast.NotEq],
    ast.NotEq: [ast.Eq],
    ast.Lt: [ast.GtE, ast.LtE],
    ast.LtE: [ast.Gt, ast.Lt],
    ast.Gt: [ast.LtE, ast.GtE],
    ast.GtE: [ast.Lt, ast.Gt],
    ast.Is: [ast.IsNot],
    ast.IsNot: [ast.Is],
    ast.In: [ast.NotIn],
    ast.NotIn: [ast.In],
}
_BINOP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
}
_SYMBOL = {
    ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
    ast.GtE: ">=", ast.Is: "is", ast.IsNot: "is not", ast.In: "in",
    ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/",
    ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.And: "and", ast.Or: "or",
}  # fmt: skip


@dataclass
class Site:
    node: ast.AST
    parent: ast.AST | None
    field: str | None
    index: int | None
    scope: str


@dataclass
class Mutant:
    """One planted defect: node `site` of the module's pre-order walk, `op` with
    its `variant` (an index into the operator's choices)."""

    target: str
    path: str
    site: int
    op: str
    variant: int
    line: int
    scope: str
    what: str
    key: str = ""
    status: str = "pending"
    seconds: float = 0.0
    failed: str = ""
    equivalent: str = ""


@dataclass
class ModuleResult:
    name: str
    path: str
    total: int
    tests: list[str]
    baseline_s: float = 0.0
    mutants: list[Mutant] = field(default_factory=list)


def _walk(tree: ast.AST) -> list[Site]:
    """Every node in a fixed pre-order with its parent and scope (dotted names of
    the enclosing functions and classes); nodes that are not mutated (logging,
    messages, annotations) are left out, with everything under them."""
    sites = []

    def visit(node, parent, fname, index, scope):
        if _quiet(node):
            return
        sites.append(Site(node, parent, fname, index, scope))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        for name, value in ast.iter_fields(node):
            if name in _SKIPPED_FIELDS:
                continue
            if isinstance(value, list):
                for i, v in enumerate(value):
                    if isinstance(v, ast.AST):
                        visit(v, node, name, i, scope)
            elif isinstance(value, ast.AST):
                visit(value, node, name, None, scope)

    visit(tree, None, None, None, "")
    return sites


def _quiet(node: ast.AST) -> bool:
    if isinstance(node, (ast.Raise, ast.Assert, ast.JoinedStr, ast.Import)):
        return True
    if isinstance(node, (ast.ImportFrom, ast.Global, ast.Nonlocal)):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return True  # a docstring
    call = node.value if isinstance(node, ast.Expr) else node
    if isinstance(call, ast.Call):
        f = call.func
        while isinstance(f, ast.Attribute):
            f = f.value
        return isinstance(f, ast.Name) and f.id in _QUIET_CALLS
    return False


def _in_scope(scope: str, only: tuple[str, ...]) -> bool:
    if not scope:
        return False  # module level: imports and constants
    return not only or any(scope == o or scope.startswith(o + ".") for o in only)


def _choices(site: Site) -> list[tuple[str, int, str]]:
    """(op, variant, description) of the mutations that apply at `site`."""
    node, out = site.node, []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for j, new in enumerate(_COMPARE[type(op)]):
                out.append(
                    ("compare", i * 2 + j, f"`{_SYMBOL[type(op)]}` -> `{_SYMBOL[new]}`")
                )
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP:
        new = _BINOP[type(node.op)]
        out.append(("binop", 0, f"`{_SYMBOL[type(node.op)]}` -> `{_SYMBOL[new]}`"))
    elif isinstance(node, ast.BoolOp):
        new = "or" if isinstance(node.op, ast.And) else "and"
        out.append(("boolop", 0, f"`{_SYMBOL[type(node.op)]}` -> `{new}`"))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        symbol = "not" if isinstance(node.op, ast.Not) else "-"
        out.append(("unary", 0, f"`{symbol}` removed"))
    elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
        new = _new_constant(node.value)
        out.append(("constant", 0, f"`{node.value!r}` -> `{new!r}`"))
    if isinstance(node, (ast.If, ast.While, ast.IfExp)):
        out.append(("negate", 0, "condition negated"))
    if isinstance(node, ast.AugAssign) and type(node.op) in _BINOP:
        new = _SYMBOL[_BINOP[type(node.op)]]
        out.append(("augop", 0, f"`{_SYMBOL[type(node.op)]}=` -> `{new}=`"))
    if _droppable(site):
        what = "`return None`" if isinstance(node, ast.Return) else "dropped"
        out.append(("drop", 0, f"statement {what}"))
    return out


def _droppable(site: Site) -> bool:
    node = site.node
    if isinstance(node, ast.Return):
        return not (isinstance(node.value, ast.Constant) and node.value.value is None)
    if isinstance(node, (ast.AugAssign, ast.Break, ast.Continue)):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Call)
    if isinstance(node, ast.Assign):
        return all(isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets)
    return False


def _new_constant(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return {0: 1, 1: 0}.get(value, value + 1)
    return 1.0 if value == 0 else value * 2


def _apply(site: Site, op: str, variant: int) -> None:
    node = site.node
    if op == "compare":
        i, j = divmod(variant, 2)
        node.ops[i] = _COMPARE[type(node.ops[i])][j]()
    elif op in ("binop", "augop"):
        node.op = _BINOP[type(node.op)]()
    elif op == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif op == "unary":
        _replace(site, node.operand)
    elif op == "constant":
        node.value = _new_constant(node.value)
    elif op == "negate":
        node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
    elif op == "drop":
        if isinstance(node, ast.Return):
            node.value = ast.Constant(value=None)
        else:
            _replace(site, ast.Pass())
    else:
        raise ValueError(op)


def _replace(site: Site, new: ast.AST) -> None:
    if site.index is None:
        setattr(site.parent, site.field, new)
    else:
        getattr(site.parent, site.field)[site.index] = new


def enumerate_mutants(target: Target, source: str) -> list[Mutant]:
    """Every mutant of `target`'s module, in source order, each with a key that
    names it across unrelated edits (scope, operator, the code it changes)."""
    tree = ast.parse(source)
    mutants, seen = [], {}
    for i, site in enumerate(_walk(tree)):
        if not _in_scope(site.scope, target.only):
            continue
        for op, variant, what in _choices(site):
            code = ast.unparse(site.node).split("\n")[0][:60]
            key = f"{target.path}:{site.scope}:{op}{variant}:{code}"
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:
                key += f"#{seen[key]}"
            line = getattr(site.node, "lineno", 0)
            mutants.append(
                Mutant(target.name, target.path, i, op, variant, line, site.scope,
                       what, key, equivalent=EQUIVALENT.get(key, ""))
            )  # fmt: skip
    return mutants


def mutated_source(source: str, mutant: Mutant) -> str:
    """The module's source with `mutant` planted (re-printed by ast.unparse)."""
    tree = ast.parse(source)
    site = _walk(tree)[mutant.site]
    _apply(site, mutant.op, mutant.variant)
    return ast.unparse(ast.fix_missing_locations(tree))


def _copy_repository() -> str:
    work = tempfile.mkdtemp(prefix="pycls_fast_mutation_")
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "out", "data", "__pycache__", "*.pyc", ".ruff_cache",
        ".pytest_cache", "*.egg-info", "build",
    )  # fmt: skip
    for name in os.listdir(ROOT):
        src = os.path.join(ROOT, name)
        if name in {".git", ".venv", "out", "data", "build"}:
            continue
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(work, name), ignore=ignore)
        else:
            shutil.copy2(src, work)
    return work


def _env(work: str) -> dict:
    env = dict(os.environ)
    # The copy, not the installed checkout; no bytecode (a stale .pyc of the same
    # size and second could hide a mutant).
    env["PYTHONPATH"] = work
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _pytest(work: str, tests, timeout: float) -> tuple[str, float, str]:
    """Runs the tests in the copy; ('passed' | 'failed' | 'timeout', seconds, the
    first failing test)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", *tests]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=work, env=_env(work), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the test's children too
        proc.communicate()
        return "timeout", time.perf_counter() - start, ""
    seconds = time.perf_counter() - start
    if proc.returncode == 0:
        return "passed", seconds, ""
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return "failed", seconds, (failed[0] if failed else out.strip()[-200:])


def _check_copy_is_imported(work: str) -> None:
    cmd = [sys.executable, "-c", "import pycls_fast; print(pycls_fast.__file__)"]
    where = subprocess.run(
        cmd, cwd=work, env=_env(work), capture_output=True, text=True, check=True
    ).stdout.strip()
    if not where.startswith(work):
        raise RuntimeError(f"the tests would import {where}, not the copy in {work}")


def _minutes(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


def run_mutants(
    results: list[ModuleResult], work: str, timeout_factor: float, pending=None
):
    """Runs every module's baseline, then its mutants (those `pending(mutant)`
    accepts, default all); prints progress and an ETA (from the mean time per
    mutant so far)."""
    pending = pending or (lambda m: True)
    total = sum(pending(m) for r in results for m in r.mutants)
    done, start = 0, time.perf_counter()
    for result in results:
        if not any(pending(m) for m in result.mutants):
            continue
        status, seconds, failed = _pytest(work, result.tests, timeout=1800)
        result.baseline_s = seconds
        if status != "passed":
            raise RuntimeError(
                f"the tests of {result.path} fail without a mutant: {failed}"
            )
        print(
            f"{result.name}: tests pass in {seconds:.1f} s; "
            f"{len(result.mutants)} of {result.total} mutants",
            flush=True,
        )
        path = os.path.join(work, result.path)
        with open(path) as f:
            source = f.read()
        timeout = timeout_factor * seconds + 30
        try:
            for m in filter(pending, result.mutants):
                with open(path, "w") as f:
                    f.write(mutated_source(source, m))
                status, m.seconds, m.failed = _pytest(work, result.tests, timeout)
                m.status = {"failed": "killed", "passed": "survived"}.get(
                    status, status
                )
                done += 1
                elapsed = time.perf_counter() - start
                eta = elapsed / done * (total - done)
                mark = " (judged equivalent)" if m.equivalent else ""
                print(
                    f"[{done}/{total}] {m.path}:{m.line} {m.scope} {m.what}: "
                    f"{m.status}{mark} in {m.seconds:.1f} s | elapsed "
                    f"{_minutes(elapsed)}, ETA {_minutes(eta)}",
                    flush=True,
                )
        finally:
            with open(path, "w") as f:
                f.write(source)


def summary(result: ModuleResult) -> dict:
    """Counts of a module's run mutants; survival = survivors not judged
    equivalent over the mutants not judged equivalent."""
    ms = result.mutants
    equivalent = [m for m in ms if m.equivalent]
    live = [m for m in ms if not m.equivalent]
    survived = [m for m in live if m.status == "survived"]
    return {
        "module": result.path,
        "mutants": len(ms),
        "of": result.total,
        "killed": sum(m.status == "killed" for m in live),
        "timeout": sum(m.status == "timeout" for m in live),
        "survived": len(survived),
        "equivalent": len(equivalent),
        "survival_pct": round(100 * len(survived) / max(len(live), 1), 1),
        "baseline_s": round(result.baseline_s, 1),
    }


def markdown(results: list[ModuleResult], args) -> str:
    lines = [
        f"Mutation run: seed {args.seed}, "
        + (
            "mutants chosen by key"
            if args.key
            else "every mutant"
            if args.all
            else f"{args.per_module} mutants per module"
        ),
        "",
        "| Module | Mutants run (of) | Killed | Timeout | Survived | Judged "
        "equivalent | Survival (non-equivalent) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = summary(r)
        lines.append(
            f"| `{s['module']}` | {s['mutants']} ({s['of']}) | {s['killed']} | "
            f"{s['timeout']} | {s['survived']} | {s['equivalent']} | "
            f"{s['survival_pct']}% |"
        )
    lines += ["", "Survivors:", ""]
    for r in results:
        for m in r.mutants:
            if m.status == "survived":
                note = f" (equivalent: {m.equivalent})" if m.equivalent else ""
                lines.append(f"- `{m.path}:{m.line}` {m.scope}: {m.what}{note}")
    return "\n".join(lines) + "\n"


def select(args) -> list[ModuleResult]:
    """The targets asked for with their mutants: all, or a sample of
    --per-module seeded by --seed and the module's path."""
    results = []
    for t in TARGETS:
        if args.module and args.module not in (t.name, t.path):
            continue
        with open(os.path.join(ROOT, t.path)) as f:
            mutants = enumerate_mutants(t, f.read())
        chosen = mutants
        if args.key:
            chosen = [m for m in mutants if m.key in args.key]
        elif not args.all and len(mutants) > args.per_module:
            rng = random.Random(f"{args.seed}:{t.path}")
            chosen = sorted(rng.sample(mutants, args.per_module), key=lambda m: m.site)
        results.append(ModuleResult(t.name, t.path, len(mutants), list(t.tests),
                                    mutants=copy.deepcopy(chosen)))  # fmt: skip
    return results


def main():
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-module", type=int, default=6,
                        help="mutants sampled per module (default 6)")  # fmt: skip
    parser.add_argument("--all", action="store_true", help="every mutant, no sample")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--module", help="one target (its name or path)")
    parser.add_argument(
        "--key", action="append", default=[],
        help="run only the mutant with this key (as --list prints it; repeatable), "
        "e.g. a survivor of an earlier run",
    )  # fmt: skip
    parser.add_argument(
        "--list", action="store_true", help="print the chosen mutants; run nothing"
    )
    parser.add_argument("--timeout-factor", type=float, default=3.0,
                        help="a mutant times out after this many times the "
                        "tests' own time, plus 30 s")  # fmt: skip
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "mutation"),
                        help="folder for results.json and report.md")  # fmt: skip
    parser.add_argument(
        "--report-from", metavar="RESULTS_JSON",
        help="write the report of an earlier run again (after judging mutants "
        "equivalent in EQUIVALENT); runs nothing",
    )  # fmt: skip
    parser.add_argument(
        "--rerun-survivors", metavar="RESULTS_JSON",
        help="run the survivors of an earlier run again against the tests as they "
        "are now (after adding tests), and write the report",
    )  # fmt: skip
    args = parser.parse_args()
    if args.per_module < 1:
        parser.error("--per-module must be at least 1")
    earlier = args.report_from or args.rerun_survivors
    if earlier:
        with open(earlier) as f:
            meta = json.load(f)
        args.seed, args.per_module = meta["seed"], meta["per_module"]
        args.all = args.per_module is None
        args.key = meta.get("keys", [])
        results = _load_results(meta)
        if args.rerun_survivors:
            work = _copy_repository()
            try:
                _check_copy_is_imported(work)
                run_mutants(results, work, args.timeout_factor, _survivor)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        _write(results, args)
        return 0
    results = select(args)
    unknown = set(args.key) - {m.key for r in results for m in r.mutants}
    if unknown:
        parser.error("--key: no such mutant: " + "; ".join(sorted(unknown)))
    results = [r for r in results if r.mutants or not args.key]
    if not results:
        parser.error(f"--module {args.module}: no such target; one of "
                     + ", ".join(t.name for t in TARGETS))  # fmt: skip
    if args.list:
        for r in results:
            for m in r.mutants:
                print(f"{m.path}:{m.line} {m.what}  [{m.key}]")
        return 0
    work = _copy_repository()
    try:
        _check_copy_is_imported(work)
        run_mutants(results, work, args.timeout_factor)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _write(results, args)
    return 0


def _survivor(m: Mutant) -> bool:
    return m.status == "survived" and not m.equivalent


def _load_results(data: dict) -> list[ModuleResult]:
    """The modules of a results.json's `data`, their mutants judged again against
    EQUIVALENT (after a judgement was added)."""
    results = []
    for mod in data["modules"]:
        mutants = [Mutant(**m) for m in mod["mutant_list"]]
        for m in mutants:
            m.equivalent = EQUIVALENT.get(m.key, "")
        name = next((t.name for t in TARGETS if t.path == mod["module"]), "")
        # The module's tests as they are now (a rerun uses the tests added since).
        tests = next((list(t.tests) for t in TARGETS if t.path == mod["module"]),
                     mod["tests"])  # fmt: skip
        results.append(ModuleResult(name, mod["module"], mod["of"], tests,
                                    mod["baseline_s"], mutants))  # fmt: skip
    return results


def _write(results: list[ModuleResult], args) -> None:
    os.makedirs(args.out, exist_ok=True)
    data = {
        "seed": args.seed,
        "per_module": None if args.all else args.per_module,
        "keys": args.key,
        "modules": [
            {**summary(r), "tests": r.tests,
             "mutant_list": [asdict(m) for m in r.mutants]}
            for r in results
        ],
    }  # fmt: skip
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(data, f, indent=1)
    report = markdown(results, args)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(report)
    print(report)
    print(f"wrote {args.out}/results.json and report.md")


if __name__ == "__main__":
    run(main)
