import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# Bounded waits stay short in tests: a broken collective fails in seconds, not in the default 10 s.
os.environ.setdefault("MEGAMOE_WAIT_TIMEOUT_MS", "5000")
