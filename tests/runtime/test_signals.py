"""SIGTERM stops purinec as Ctrl-C does: cleanups run, and the exit status says which."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from purinec.runtime.signals import Terminated, interruption, terminating

STOPPED_MID_WRITE = textwrap.dedent("""
    import os, signal, sys
    from purinec.fileio import replacing
    from purinec.runtime.signals import interruption, terminating
    try:
        with terminating(), replacing(sys.argv[1]) as tmp:
            with open(tmp, "w") as f:
                f.write("half of it")
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()
    except KeyboardInterrupt as err:
        what, status = interruption(err)
        print(what)
        sys.exit(status)
""")


def test_sigterm_mid_write_removes_the_temporary_file_and_exits_143(tmp_path):
    done = subprocess.run([sys.executable, "-c", STOPPED_MID_WRITE, str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (143, "terminated"), done.stderr
    assert os.listdir(tmp_path) == []


def test_terminating_raises_in_the_main_thread_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with terminating():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_interruption_is_named_with_its_shell_status():
    assert interruption(KeyboardInterrupt()) == ("interrupted", 130)
    assert interruption(Terminated()) == ("terminated", 143)
