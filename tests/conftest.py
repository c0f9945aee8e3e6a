import os
import sys

from hypothesis import HealthCheck, settings

# Profiles of the property tests (tests/test_properties.py): "ci" is deterministic and
# sized for about 4 minutes on 2 cores; NPU_FUSION_PROPERTY_PROFILE=long runs thousands
# of examples per test from a random seed (NPU_FUSION_PROPERTY_EXAMPLES sets how many).
settings.register_profile("ci", max_examples=150, derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=int(os.environ.get("NPU_FUSION_PROPERTY_EXAMPLES", 2000)),
                          derandomize=False, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("NPU_FUSION_PROPERTY_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter):
    """The property tests' counts: examples, rewrites, false rewrites, pass exceptions."""
    module = sys.modules.get("test_properties")
    if module is None or not module.STATS:
        return
    terminalreporter.section("npu_fusion property tests")
    stats = module.STATS
    for key in ("examples", "rewrites (sites fused)", "false rewrites", "pass exceptions"):
        terminalreporter.write_line(f"{key}: {stats[key]}")
    for key in sorted(k for k in stats if k not in ("examples", "rewrites (sites fused)", "false rewrites",
                                                      "pass exceptions")):
        terminalreporter.write_line(f"{key}: {stats[key]}")
    if module.KEEP_GOING:
        for kind, text in module.FAILURES:
            terminalreporter.write_line(f"\n--- {kind}\n{text}")
