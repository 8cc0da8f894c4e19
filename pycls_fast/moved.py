"""Old import paths of modules that moved (docs/ARCHITECTURE.md), kept working.

Forks and notebooks written against the layout before `core/` was split import
`pycls_fast.core.trainer`, `pycls_fast.datasets.device`, ...: a finder on
`sys.meta_path` answers those names with the module at its new place (the same
module object, so patches and isinstance checks see one module). New code imports
the new paths; nothing in the package uses the old ones.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

MOVED = {
    "pycls_fast.core.distributed": "pycls_fast.runtime.distributed",
    "pycls_fast.core.device_info": "pycls_fast.runtime.device_info",
    "pycls_fast.core.preemption": "pycls_fast.runtime.preemption",
    "pycls_fast.core.run_lock": "pycls_fast.runtime.run_lock",
    "pycls_fast.core.logging": "pycls_fast.observe.logging",
    "pycls_fast.core.console": "pycls_fast.observe.console",
    "pycls_fast.core.stats_sinks": "pycls_fast.observe.stats_sinks",
    "pycls_fast.core.plots": "pycls_fast.observe.plots",
    "pycls_fast.core.profiling": "pycls_fast.observe.profiling",
    "pycls_fast.core.precision": "pycls_fast.components.precision",
    "pycls_fast.core.optimizer": "pycls_fast.components.optimizer",
    "pycls_fast.core.ema": "pycls_fast.components.ema",
    "pycls_fast.core.meters": "pycls_fast.components.meters",
    "pycls_fast.core.losses": "pycls_fast.components.losses",
    "pycls_fast.core.mesh": "pycls_fast.parallel.mesh",
    "pycls_fast.core.tensor_parallel": "pycls_fast.parallel.tensor_parallel",
    "pycls_fast.core.pipeline": "pycls_fast.parallel.pipeline",
    "pycls_fast.core.planner": "pycls_fast.parallel.planner",
    "pycls_fast.core.parallel": "pycls_fast.parallel.data_parallel",
    "pycls_fast.core.checkpoint": "pycls_fast.checkpoint",
    "pycls_fast.core.trainer": "pycls_fast.engine.trainer",
    "pycls_fast.core.evaluation": "pycls_fast.engine.evaluation",
    "pycls_fast.core.timing": "pycls_fast.engine.timing",
    "pycls_fast.core.distill": "pycls_fast.engine.distill",
    "pycls_fast.core.launch": "pycls_fast.launch.processes",
    "pycls_fast.core.submit": "pycls_fast.launch.submit",
    "pycls_fast.core.cli": "pycls_fast.launch.cli",
    "pycls_fast.datasets.index": "pycls_fast.datasets.formats.index",
    "pycls_fast.datasets.shards": "pycls_fast.datasets.formats.shards",
    "pycls_fast.datasets.pack": "pycls_fast.datasets.formats.pack",
    "pycls_fast.datasets.prepare": "pycls_fast.datasets.formats.prepare",
    "pycls_fast.datasets.progress": "pycls_fast.datasets.formats.progress",
    "pycls_fast.datasets.digits": "pycls_fast.datasets.formats.digits",
    "pycls_fast.datasets.synthetic": "pycls_fast.datasets.formats.synthetic",
    "pycls_fast.datasets.decode": "pycls_fast.datasets.images.decode",
    "pycls_fast.datasets.augment": "pycls_fast.datasets.images.augment",
    "pycls_fast.datasets.transforms": "pycls_fast.datasets.images.transforms",
    "pycls_fast.datasets.batch": "pycls_fast.datasets.modes.batch",
    "pycls_fast.datasets.sharding": "pycls_fast.datasets.modes.sharding",
    "pycls_fast.datasets.threaded": "pycls_fast.datasets.modes.threaded",
    "pycls_fast.datasets.spdl_pipeline": "pycls_fast.datasets.modes.spdl_pipeline",
    "pycls_fast.datasets.processes": "pycls_fast.datasets.modes.processes",
    "pycls_fast.datasets.device": "pycls_fast.datasets.to_device.transform",
    "pycls_fast.datasets.prefetch": "pycls_fast.datasets.to_device.prefetch",
    # engine/trainer.py's split: the run's precise BN joined its computation.
    "pycls_fast.engine.precise_bn": "pycls_fast.components.precise_bn",
}
# Old packages that no longer exist as folders: empty packages whose submodules are
# the moved modules above.
OLD_PACKAGES = {"pycls_fast.core"}


class _MovedLoader(importlib.abc.Loader):
    def create_module(self, spec):
        if spec.name in OLD_PACKAGES:
            module = types.ModuleType(spec.name, "moved: see pycls_fast.moved")
            module.__path__ = []
            return module
        return importlib.import_module(_new_name(spec.name))

    def exec_module(self, module):
        pass


def _new_name(old: str) -> str:
    """The new dotted name of `old` or of a module under an old package."""
    for prefix in sorted(MOVED, key=len, reverse=True):
        if old == prefix or old.startswith(prefix + "."):
            return MOVED[prefix] + old[len(prefix) :]
    raise ModuleNotFoundError(old)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in OLD_PACKAGES:
            return importlib.machinery.ModuleSpec(
                fullname, _MovedLoader(), is_package=True
            )
        try:
            _new_name(fullname)
        except ModuleNotFoundError:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader())


def install() -> None:
    """Adds the finder once (after the normal ones: a real module always wins)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
