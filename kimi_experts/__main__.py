"""`python -m kimi_experts` runs the demo (see kimi_experts/demo.py)."""

from .demo import main

raise SystemExit(main())
