"""GPU tests import the CPU tests' case tables and workers from the parent folder."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A launcher that starts us with SIGINT ignored (Python then installs no handler) would turn
# gpu_check.sh's SIGINT stop, which lets pytest report failures and durations, into a plain kill.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
