"""GPU tests import the CPU tests' case tables and workers from the parent folder."""

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A launcher that starts us with SIGINT ignored (Python then installs no handler) would turn
# gpu_check.sh's SIGINT stop, which lets pytest report failures and durations, into a plain kill.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The main process only checks results on the CPU (the float64 per-token layer reference among them):
# thousands of tiny ops, which a pool of one thread per core of a large GPU host slows many times over.
torch.set_num_threads(min(4, torch.get_num_threads()))
