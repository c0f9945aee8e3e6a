import collections
import os
import sys

# Before torch is imported: the suite's tensors are tiny and its two xdist workers share two cores, so
# each worker runs torch's kernels on one thread (a thread per core in each made the suite a fifth
# to a quarter slower) and Inductor compiles in the worker, not in a pool of subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also where a plugin imported torch first

# Profiles of the property tests (tests/test_properties.py): "ci" is deterministic and
# sized for about 4 minutes on 2 cores; NPU_FUSION_PROPERTY_PROFILE=long runs thousands
# of examples per test from a random seed (NPU_FUSION_PROPERTY_EXAMPLES sets how many).
settings.register_profile("ci", max_examples=150, derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=int(os.environ.get("NPU_FUSION_PROPERTY_EXAMPLES", 2000)),
                          derandomize=False, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("NPU_FUSION_PROPERTY_PROFILE", "ci"))


#: what the property tests counted in the xdist workers (``-n 2``), summed on the controller
WORKER_STATS: collections.Counter = collections.Counter()
WORKER_FAILURES: list = []


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):  # its hooks exist only with the plugin installed
        config.pluginmanager.register(PropertyStatsFromWorkers())


class PropertyStatsFromWorkers:
    """Carries each xdist worker's property-test counts to the controller, which prints them."""

    @pytest.hookimpl
    def pytest_sessionfinish(self, session):
        module = sys.modules.get("test_properties")
        if hasattr(session.config, "workeroutput") and module is not None:
            session.config.workeroutput["property_stats"] = dict(module.STATS)
            session.config.workeroutput["property_failures"] = list(module.FAILURES)

    @pytest.hookimpl
    def pytest_testnodedown(self, node, error):
        output = getattr(node, "workeroutput", {})
        WORKER_STATS.update(output.get("property_stats", {}))
        WORKER_FAILURES.extend(tuple(f) for f in output.get("property_failures", ()))


def pytest_terminal_summary(terminalreporter):
    """The property tests' counts: examples, rewrites, false rewrites, pass exceptions."""
    module = sys.modules.get("test_properties")
    stats = WORKER_STATS if WORKER_STATS else (module.STATS if module is not None else None)
    if not stats:
        return
    failures = WORKER_FAILURES if WORKER_STATS else module.FAILURES
    terminalreporter.section("npu_fusion property tests")
    for key in ("examples", "rewrites (sites fused)", "false rewrites", "pass exceptions"):
        terminalreporter.write_line(f"{key}: {stats[key]}")
    for key in sorted(k for k in stats if k not in ("examples", "rewrites (sites fused)", "false rewrites",
                                                      "pass exceptions")):
        terminalreporter.write_line(f"{key}: {stats[key]}")
    if os.environ.get("NPU_FUSION_PROPERTY_KEEP_GOING", "") not in ("", "0"):  # test_properties.KEEP_GOING
        for kind, text in failures:
            terminalreporter.write_line(f"\n--- {kind}\n{text}")
