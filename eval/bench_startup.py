"""How long ``specd serve --target FILE`` takes from its start to ``/readyz`` 200, with the model cache
warm and on a file's first load (issue #42's "ready to serve a 1.7B file in under 10 s, first load
included").

    taskset -c 1 python -m eval bench startup --target ~/.cache/specd/bench-scale/1.7b-q4_0.gguf --runs 5

Each run starts ``python -m specd serve --target FILE --port 0 --grpc-port 0 --log-level info [FLAGS]``
as a child process (inheriting this process's CPU affinity: run the tool under ``taskset`` to pin
it), reads the port from its "listening" log line, asks ``/readyz`` every 20 ms until it answers
200, then stops it with SIGTERM. Start-to-ready is the wall time from just before the child is
started to the first 200; beside it, the CPU seconds both processes (server and engine) used up to
then (/proc), which a busy machine disturbs less than wall time; the JSON log lines' arrival times
give the phases (listening, loading models, the engine's kernel, KV cache, ready; any line whose
message is listed in ``PHASES``). ``SPECD_CACHE_DIR`` is passed on to the servers (other ``SPECD_*``
settings are not).

Modes (``--modes``, default both, alternating run by run so a drift in the machine's load hits both):

- ``warm``: specd's per-file cache as the checkout's previous start left it (its first-load run just
  before, or an untimed start where only ``warm`` runs);
- ``first``: before each run, what specd caches per GGUF file is removed
  (``specd.model.gguf.cached_folders``: the converted config/tokenizer folder, the full conversion
  if any, and the measured row costs the warm-up keeps per file and CPU). The file itself stays in
  the OS page cache (a cold disk is the machine's, not specd's); the compiled CPU kernel and the
  per-machine dtype choice are kept (they are per machine and source, not per file). For the built-in
  model that removes ``specd setup``'s converted folder too: run ``specd setup`` afterwards.

``--repo DIR`` (repeatable) runs that checkout's specd (its ``python -m specd`` from DIR, on this
interpreter), the checkouts alternating run by run: a before/after comparison in one run. Writes
``results.json`` and ``summary.md`` to ``--out`` (default ``eval/out/bench_startup-DATE``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from eval import harness as H
from eval.serve_check import probe

COMMAND = "bench startup"
PHASES = ("listening", "loading models", "quantized CPU kernel", "KV cache", "ready", "row costs seeded")


def _env(repo: Path) -> dict:
    """The servers' (and the cache clearing's) environment: ``harness.clean_env`` with ``repo`` on the
    path, and this process's ``SPECD_CACHE_DIR`` where it has one (the cache the runs share)."""
    env = dict(H.clean_env(), PYTHONPATH=str(repo))
    if os.environ.get("SPECD_CACHE_DIR"):
        env["SPECD_CACHE_DIR"] = os.environ["SPECD_CACHE_DIR"]
    return env


def clear_file_cache(target: Path, repo: Path) -> list:
    """Remove what specd (the checkout at ``repo``) caches for the GGUF file ``target``; the removed paths."""
    code = (
        "import json, sys; from pathlib import Path; from specd.model.gguf import cached_folders; "
        "from specd.engine.warmup import cost_cache_file; t = Path(sys.argv[1]); "
        "print(json.dumps([str(p) for p in [*cached_folders(t), cost_cache_file(t)]]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(target)], cwd=repo, env=_env(repo), capture_output=True, text=True
    )
    if out.returncode != 0:  # (a checkout from before cached_folders: its folders by their naming scheme)
        return _clear_by_name(target)
    import shutil

    paths = [Path(p) for p in json.loads(out.stdout)]
    for p in paths:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return paths


def _clear_by_name(target: Path) -> list:
    import hashlib
    import shutil

    from specd.model.gguf import cache_root

    where = hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:10]
    paths = list(cache_root().glob(f"{target.stem}-{where}-*"))
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    return paths


def one_start(target: Path, flags: list, repo: Path, timeout: float = 600.0) -> dict:
    """Start the server once, wait for ``/readyz`` 200, stop it: {ready_s, phases: {msg: s}, exit}."""
    cmd = [sys.executable, "-m", "specd", "serve", "--target", str(target), "--port", "0", "--grpc-port", "0"]
    cmd += ["--log-level", "info", *flags]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=repo, env=_env(repo), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    phases: dict = {}
    port: list = []
    logs: list = []

    def read() -> None:
        for line in proc.stderr:
            t = time.monotonic() - t0
            logs.append(line)
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            msg = rec.get("msg", "") if isinstance(rec, dict) else ""
            for p in PHASES:
                if msg.startswith(p) and p not in phases:
                    phases[p] = round(t, 3)
            if msg == "listening":
                port.append(rec["port"])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready, cpu = None, {}
    try:
        while ready is None:
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError("specd serve did not get ready:\n" + "".join(logs[-30:]))
            if port and probe(port[0], "/readyz")[0] == 200:
                ready = time.monotonic() - t0
                kids = H.child_pids(proc.pid)
                cpu = {"server": _own_cpu(proc.pid), "engine": sum(H.process_cpu_seconds(c) for c in kids)}
                break
            time.sleep(0.02)
    finally:
        status = H.end_process(proc, 60)
        reader.join(5)
    return {"ready_s": round(ready, 3), "cpu_s": {k: round(v, 2) for k, v in cpu.items()}, "phases": phases,
            "exit": status}  # fmt: skip


def _own_cpu(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` alone (its children not counted)."""
    return H.process_cpu_seconds(pid) - sum(H.process_cpu_seconds(c) for c in H.child_pids(pid))


def run(target: Path, modes: list, runs: int, flags: list, repos: list) -> dict:
    """{repo: {mode: medians and runs}} of ``runs`` starts per repo and mode, alternating run by run."""
    out: dict = {repo: {m: [] for m in modes} for repo in repos}
    order = sorted(modes)  # ("first" before "warm": a checkout's warm start follows its own first load,
    # not another checkout's, which may keep other things per file)
    if order == ["warm"]:  # (warm starts remove nothing: one start fills the cache for all of them)
        for repo in repos:
            H.log(f"untimed start (fills the cache): {target.name}, {repo}")
            one_start(target, flags, repo)
    for i in range(runs):
        for repo in repos:
            for m in order:
                if m == "first":
                    clear_file_cache(target, repo)
                r = one_start(target, flags, repo)
                what = f"ready after {r['ready_s']:.2f} s, CPU {r['cpu_s']} {r['phases']}"
                H.log(f"{target.name} {repo.name} {m} run {i + 1}/{runs}: {what}")
                out[repo][m].append(r)
    return {str(repo): {m: summary(rs) for m, rs in by_mode.items()} for repo, by_mode in out.items()}


def summary(rs: list) -> dict:
    """Medians of start-to-ready and of both processes' CPU seconds to ready, with the runs."""
    return {"median_ready_s": round(statistics.median(r["ready_s"] for r in rs), 2),
            "median_cpu_s": round(statistics.median(sum(r["cpu_s"].values()) for r in rs), 2), "runs": rs}  # fmt: skip


def phase_medians(runs: list) -> dict:
    names = [p for p in PHASES if all(p in r["phases"] for r in runs)]
    return {p: round(statistics.median(r["phases"][p] for r in runs), 2) for p in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval bench startup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", required=True, help="a GGUF file or model folder (repeatable)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", default="warm,first", help="warm, first or both (comma-separated)")
    ap.add_argument("--repo", action="append", help="a specd checkout to run (repeatable; default: this one)")
    ap.add_argument("--out", default=None)
    ap.add_argument("flags", nargs="*", help="more `specd serve` flags (after --)")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"warm", "first"} or a.runs < 1:
        ap.error("--modes takes warm and/or first; --runs >= 1")
    repos = [Path(r).resolve() for r in (a.repo or [H.ROOT])]
    results = {"meta": H.run_meta(COMMAND, sys.argv[1:] if argv is None else argv), "repos": [str(r) for r in repos]}
    results["affinity"] = sorted(os.sched_getaffinity(0))
    rows = []
    for t in a.target:
        path = Path(t).expanduser()
        r = results[path.name] = run(path, modes, a.runs, a.flags, repos)
        for repo in repos:
            for m in modes:
                med = r[str(repo)][m]
                phases = json.dumps(phase_medians(med["runs"]))
                rows.append([path.name, repo.name, m, a.runs, med["median_ready_s"], med["median_cpu_s"], phases])
    out = H.out_dir(a.out, "bench_startup")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    head = ["file", "checkout", "mode", "runs", "median start to /readyz 200 (s)", "CPU s to ready (both processes)"]
    table = H.md_table([*head, "phases (medians, s)"], rows)
    (out / "summary.md").write_text(f"CPUs {results['affinity']}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
