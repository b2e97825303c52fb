"""The model-server launcher's failures are typed and say where the server's log is."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sparseety.errors import ModelServerError
from sparseety.stack.server_process import ServerProcess


def test_a_server_that_exits_raises_with_its_code_and_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(ModelServerError) as info:
        ServerProcess(command, dict(os.environ), log, what="the test server", timeout_s=30)
    err = info.value
    assert err.fields == {"what": "the test server", "log": str(log), "returncode": 3}
    assert "exited with 3" in str(err) and "no model here" in str(err)


def test_a_server_that_never_answers_is_stopped_and_raises(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(ModelServerError) as info:
        ServerProcess(command, dict(os.environ), log, what="the silent server", timeout_s=1)
    assert info.value.fields["returncode"] is None and "not ready after 1 s" in str(info.value)
