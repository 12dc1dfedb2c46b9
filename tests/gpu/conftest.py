"""GPU tests import the CPU tests' case tables and workers from the parent folder."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
