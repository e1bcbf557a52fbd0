"""
torchrun, without the launcher's traceback after a user's mistake: what the shell recipes (runs/*.sh) launch with.

    python runs/launch.py --standalone --nproc_per_node=2 chat_rl.py --tools    # exactly torchrun's arguments

A stage that stops on a mistake of the user's (common.UserError: a run directory that holds another run, a
malformed row) prints one `error: ...` line on rank 0 and exits with code 2 on every rank. torchrun then raises
its ChildFailedError, whose traceback and table of failed ranks bury that line. Here, when every rank that
failed exited with code 2, the launcher exits with code 2 and nothing more; any other failure (a bug of ours,
a crash, a kill) keeps torchrun's whole report.
"""
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

USER_ERROR = 2  # common.run_main's exit code for a UserError


def main(argv):
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        if {failure.exitcode for failure in e.failures.values()} == {USER_ERROR}:
            sys.exit(USER_ERROR)  # rank 0 has said why, in one line
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
