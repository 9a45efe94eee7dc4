"""driver/interrupt.py: the first Ctrl-C (SIGINT) or SIGTERM asks the loop to stop after its step, saying which
and how to abort; the same again aborts (KeyboardInterrupt); the handlers before it are back afterwards. Outside
the loop driver.train.main stops on SIGTERM as on Ctrl-C."""

import os
import signal

import pytest

import driver.train
from driver.interrupt import GracefulInterrupt


@pytest.mark.parametrize(("signum", "said"), [
    (signal.SIGINT, "interrupt: stopping after this step and saving a checkpoint (Ctrl-C again to abort)"),
    (signal.SIGTERM, "SIGTERM: stopping after this step and saving a checkpoint (again to abort)"),
])
def test_the_first_signal_asks_to_stop_and_the_second_aborts(signum, said, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with GracefulInterrupt() as interrupt:
        assert not interrupt.requested
        os.kill(os.getpid(), signum)
        assert interrupt.requested and interrupt.signal == signum
        assert said in capsys.readouterr().out
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signum)
    assert {s: signal.getsignal(s) for s in before} == before


def test_sigterm_before_the_loop_stops_the_run_as_ctrl_c_does(monkeypatch, capsys):
    def terminated_while_loading(_config):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop it")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(driver.train, "run", terminated_while_loading)
    with pytest.raises(SystemExit) as stopped:
        driver.train.main(["--rollout.backend=transformers"])
    assert stopped.value.code == driver.train.INTERRUPTED_EXIT_CODE
    assert "interrupted: stopped without saving a checkpoint" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
