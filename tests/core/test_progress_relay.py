"""Progress of parallel worker processes (the SFT roles) is drawn by the parent, one bar
per job: workers never write bars themselves, so two bars cannot overwrite each other's
line, and in a log each job's progress lines arrive whole."""
import io
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from memopd.progress import BarRelay


def _job(args):
    queue, name, steps = args
    import sys

    from memopd.progress import progress_bar, relay_to

    relay_to(queue)
    sys.stderr = open("/dev/null", "w")  # a worker that wrote its own bar would write here
    bar = progress_bar(steps, f"sft {name}", unit="step")
    for i in range(steps):
        bar.set_postfix(loss=f"{1.0 / (i + 1):.3f}")
        bar.update(1)
    bar.close()
    return name


class _Log(io.StringIO):
    def isatty(self):
        return False


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _run(stream, steps=20):
    with BarRelay(stream=stream) as relay:
        with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as ex:
            done = list(ex.map(_job, [(relay.queue, "teacher", steps), (relay.queue, "student", steps)]))
    return done


def test_parallel_jobs_progress_lines_in_a_log_are_whole():
    log = _Log()
    assert _run(log) == ["teacher", "student"]
    lines = log.getvalue().splitlines()
    for name in ("teacher", "student"):
        mine = [x for x in lines if x.startswith(f"sft {name}: ")]
        assert mine and mine[-1].startswith(f"sft {name}: 20/20 step (100%)"), lines
        assert "loss=0.050" in mine[-1]
    assert all(x.startswith(("sft teacher: ", "sft student: ")) for x in lines), lines


def test_parallel_jobs_bars_on_a_terminal_keep_one_line_each():
    term = _Terminal()
    _run(term)
    out = term.getvalue()
    # tqdm in one process: each bar keeps its own position, both reach 100%
    assert "sft teacher: 100%" in out and "sft student: 100%" in out
