import sys
from pathlib import Path

# tests import their shared harness modules (pattern_harness) by name
sys.path.insert(0, str(Path(__file__).parent))
