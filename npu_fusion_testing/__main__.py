"""``python -m npu_fusion_testing report --framework LIBRARY:MODEL ...`` (from the repository root)."""
from .report import main

raise SystemExit(main())
