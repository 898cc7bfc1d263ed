"""Reading frugal's JSON-lines reports: the step records, apart from eval and event records."""
import json


def step_records(path):
    """The records of training steps in a `--report` file, in order. Step records carry
    time_ms; evaluation records ("event": "eval") and events such as "end" are left out."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "time_ms" in r and "event" not in r]
