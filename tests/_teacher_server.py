"""A real `memopd serve-teacher` process on a loopback port, for the tests that talk to one
(tests/trainer/test_served_teacher.py, tests/with_verl): `served(model_dir, *args)` starts
it with this interpreter from the repository root, waits for the line that gives its
address, yields (process, url) and stops it afterwards."""
from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
URL_LINE = re.compile(r"on (http://[0-9.]+:\d+)")


@contextlib.contextmanager
def served(model_dir, *args, port=0):
    """A `memopd serve-teacher` process on loopback (port 0: a free one); yields (process, url)."""
    cmd = [sys.executable, "-m", "memopd.cli", "serve-teacher", str(model_dir), "--port", str(port), "--threads", "1", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        try:
            first = lines.get(timeout=120)
        except queue.Empty:
            first = ""
        m = URL_LINE.search(first)
        assert m, f"the server did not start: {first!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        yield proc, m.group(1)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
