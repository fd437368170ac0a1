"""fagen launch: torchrun's variables, and a failing rank reported instead of a hang (CPU)."""

import sys
import time

from click.testing import CliRunner

from fagen.cli import main
from fagen.distributed import launch

REPORT = """
import os, sys
print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"],
      bool(os.environ["FAGEN_RENDEZVOUS"]), os.environ["NCCL_NVLS_ENABLE"], file=sys.stderr)
"""

FAIL_ON_RANK_1 = """
import os, time
if os.environ["RANK"] == "1":
    raise RuntimeError("rank one broke")
time.sleep(60)  # rank 0 would wait forever for a peer that died
"""


def test_every_rank_gets_torchrun_variables(tmp_path, capfd):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    assert launch(3, [str(script)]) == 0
    err = capfd.readouterr().err  # each rank's stderr comes back prefixed with its rank
    for rank in range(3):
        assert f"[rank {rank}] {rank} 3 {rank} 127.0.0.1 True 0" in err


def test_a_failing_rank_stops_the_others_and_is_reported(tmp_path, capfd):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_RANK_1)
    start = time.monotonic()
    code = launch(2, [str(script)])
    err = capfd.readouterr().err
    assert code == 1
    assert time.monotonic() - start < 30  # rank 0's sleep(60) was cut short
    assert "[rank 1]" in err and "rank one broke" in err and "rank 1 failed" in err


def test_timeout_stops_every_rank(tmp_path, capfd):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(60)\n")
    assert launch(2, [str(script)], timeout_s=1.0) == 124
    assert "timed out" in capfd.readouterr().err


def test_cli_passes_script_arguments_through(tmp_path):
    script = tmp_path / "args.py"
    script.write_text("import sys\nassert sys.argv[1:] == ['--flag', 'x'], sys.argv\n")
    result = CliRunner().invoke(main, ["launch", "-n", "2", str(script), "--flag", "x"])
    assert result.exit_code == 0, result.output
    assert sys.executable  # launched with this interpreter
