"""tests/ops: compose.yaml, the images and the stack. Its helper modules (compose_model,
stack) are imported by name, like tests/'s own."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
