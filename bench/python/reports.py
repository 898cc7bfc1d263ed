"""What the twins share: reading frugal's JSON-lines reports (the step records, apart from
eval and event records), and the warm-up steps left out of each run's figures."""
import json

WARMUP = 10


def add_warmup(parser):
    """The `--warmup` flag: the first steps of each run, left out of the figures."""
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help="first steps of each run left out of the figures")


def check_warmup(parser, args):
    """Refuses a run with no step after its warm-up, naming both values."""
    if args.warmup < 0 or args.steps <= args.warmup:
        parser.error(f"--steps must be more than the {args.warmup} warm-up steps, "
                     f"got {args.steps}")


def step_records(path):
    """The records of training steps in a `--report` file, in order. Step records carry
    time_ms; evaluation records ("event": "eval") and events such as "end" are left out."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "time_ms" in r and "event" not in r]
