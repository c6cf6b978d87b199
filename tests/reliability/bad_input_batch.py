"""Run many bad-input cases of the project's entry points in one Python process (test_bad_inputs.py).

`python tests/reliability/bad_input_batch.py JOBS.json RESULTS.json`: JOBS is a list of
`{"id", "module" | "script", "args", "cwd"}`. Each job runs like `python -m module args` (or `python script args`)
would: `sys.argv` set, `__main__` executed with `runpy`, from `cwd`, stdout and stderr captured. Its exit code is
the `SystemExit` code (0 when it returns); an escaping exception prints its traceback to the captured stderr and
counts as exit code 1, as the interpreter would. RESULTS maps each id to `{"returncode", "stdout", "stderr"}`.

Importing torch, transformers and Hydra once for the whole corpus instead of once per case is what makes the
corpus cheap; the few cases that start Ray keep running as real subprocesses.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def run_job(job: dict) -> dict:
    out, err = io.StringIO(), io.StringIO()  # never closed: a logging handler made by one case may keep writing
    target = job.get("module") or job["script"]
    argv0 = job.get("script") or target
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    code = 0
    sys.argv = [argv0, *job["args"]]
    os.chdir(job["cwd"])
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if "module" in job:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(target, run_name="__main__")
            except SystemExit as e:
                if e.code is None:
                    code = 0
                elif isinstance(e.code, int):
                    code = e.code
                else:  # sys.exit("message") prints the message and exits 1
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:  # noqa: BLE001 - reported like an uncaught exception in a real process
                traceback.print_exc(file=sys.stderr)
                code = 1
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    jobs_path, results_path = sys.argv[1], sys.argv[2]
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = {job["id"]: run_job(job) for job in jobs}
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
