"""Hostile request mixes and injected faults against the engine, in process: the robustness figure.

    OMP_NUM_THREADS=1 .venv/bin/python -m eval load hostile --cases 2000 --seed 0 --json eval/out/hostile.json

Part 1 runs ``--cases`` random cases (``specd.engine.chaos.random_case``: 1-5 requests over the whole
accepted parameter range, a quarter with a value validation refuses forced in past it, half the cases
with a fault injected in a random stage for one request; small KV cache, so preemption happens) and
checks the oracle of ``specd.engine.chaos.run_checked`` after each: every request ends once, no request that
is neither hostile nor the fault's target fails, no KV block is held, and the greedy canary equals a
fresh engine's output. Part 2 injects a fault in each stage for one request of a fixed mix and counts
the other requests whose tokens differ from their clean run (must be 0). Prints one JSON summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
from pathlib import Path

from eval import harness as H

COMMAND = "load hostile"  # python -m eval load hostile (this module's ``main``)


def build_engine(num_blocks: int):
    return H.engine_from_flags(
        [
            "--target",
            str(H.SHARED / "models" / "stories260K"),
            "--draft",
            str(H.SHARED / "models" / "stories260K-draft-1L64"),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-blocks",
            str(num_blocks),
            "--prefill-chunk",
            "24",
        ]
    )


def random_cases(engine, n: int, seed: int, canary_prompt, canary_ref) -> dict:
    from specd.engine.chaos import random_case, run_checked

    rng = random.Random(seed)
    tot = collections.Counter()
    for _ in range(n):
        reqs, fault = random_case(rng, engine.vocab_size)
        tot.update(run_checked(engine, reqs, fault, canary_prompt, canary_ref))
        tot["cases"] += 1
    return dict(tot)


def stage_faults(engine, prompts: dict) -> dict:
    """A fault in each stage for one request of a fixed mix: the others' tokens vs their clean run."""
    from specd.engine.chaos import STEP_STAGES, FaultInjector, Req, check_clean, run_case, with_hook
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=12, ignore_eos=True)
    mix = [
        Req("g-tree", prompts[0], greedy, SpecParams("tree")),
        Req("g-chain", prompts[1], greedy, SpecParams("chain")),
        Req("s-tree", prompts[0], sampled, SpecParams("tree")),
        Req("g-off", prompts[2], greedy, SpecParams("off")),
    ]
    clean = run_case(engine, mix)
    out = {"innocent_requests": 0, "innocent_differing": 0, "culprits_failed": 0}
    for stage in STEP_STAGES:
        for skip in (0, 2):
            bad = Req("bad", prompts[1], sampled, SpecParams("tree"))
            res = with_hook(
                engine, FaultInjector(stage, {"bad"}, skip=skip), lambda bad=bad: run_case(engine, mix + [bad])
            )
            out["culprits_failed"] += res.reasons["bad"] == "error"
            for r in mix:
                out["innocent_requests"] += 1
                out["innocent_differing"] += res.outputs[r.rid] != clean.outputs[r.rid]
            check_clean(engine)
    out["stage_faults"] = 2 * len(STEP_STAGES)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=40)
    ap.add_argument("--json", default=None, help="also write the summary here")
    a = ap.parse_args(argv)
    import torch

    from specd.engine.chaos import canary
    from specd.model.cpu import cpu_info

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    engine = build_engine(a.num_blocks)
    prompts = [engine.tokenizer(p)["input_ids"] for p in ("Once upon a time", "The dog ran to the", "Lily saw a")]
    canary_ref = canary(build_engine(a.num_blocks), prompts[0])
    t0 = time.perf_counter()
    summary = {
        "cpu": cpu_info()["model"],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "command": H.command_line(COMMAND, argv),
        "random": random_cases(engine, a.cases, a.seed, prompts[0], canary_ref),
        "stages": stage_faults(engine, prompts),
        "health": engine.health_snapshot(),
        "kv_blocks_held_after": list(engine.kv_blocks_used()),
    }
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(summary, indent=1)
    print(text)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
