"""``python -m fused_ops``: see fused_ops.cli."""
from .cli import main

raise SystemExit(main())
