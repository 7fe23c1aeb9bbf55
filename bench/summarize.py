"""Collect the headline figures that bench/README.md's tables cite into ``bench/results/summary.json``.

    python bench/summarize.py [--out bench/results/summary.json]

``bash bench/run_all.sh`` runs it after the benchmarks. It reads each benchmark's JSON in ``bench/results/`` (a
missing file is listed under ``missing``, not an error: the GPU check's JSON only exists after a GPU session) and
writes, per benchmark, ``file`` (the JSON it read), ``key`` (where in that JSON the figures are) and ``figures``
(``label -> value``): the ratios and rates the README's tables and prose quote, so a change in a rerun shows in one
diff. Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import harness

Extractor = Callable[[dict], dict]
EXTRACTORS: dict[str, tuple[str, str, Extractor]] = {}
"""Benchmark -> (its JSON under bench/results/, the keys the figures come from, the function that takes them)."""


def figures(name: str, file: str, key: str) -> Callable[[Extractor], Extractor]:
    """Register the extractor of benchmark ``name`` (``file`` in bench/results/; ``key``: where its figures are)."""

    def register(fn: Extractor) -> Extractor:
        EXTRACTORS[name] = (file, key, fn)
        return fn

    return register


@figures("train_throughput", "train_throughput.json", "tables[].rows[].vs, tables[].rows[].real_tok_s")
def _train_throughput(d: dict) -> dict:
    out = {}
    for table in d["tables"]:
        t = f"{table['threads']}t"
        for r in table["rows"]:
            out[f"{t} {r['dataset']} {r['mode']} real_tok_s"] = r["real_tok_s"]
            for base, v in r.get("vs", {}).items():
                out[f"{t} {r['dataset']} {r['mode']} vs {base} gain"] = v["gain"]
                out[f"{t} {r['dataset']} {r['mode']} vs {base} of_ideal"] = v["of_ideal"]
    return out


@figures(
    "vs_transformers_packer_2threads",
    "vs_transformers_packer_2threads.json",
    "workloads[].ours_packed_over, workloads[].ideal_gain_*",
)
@figures(
    "vs_transformers_packer", "vs_transformers_packer.json", "workloads[].ours_packed_over, workloads[].ideal_gain_*"
)
@figures(
    "vs_transformers_2threads",
    "vs_transformers_2threads.json",
    "workloads[].ours_packed_over, workloads[].ideal_gain_*",
)
@figures("vs_transformers", "vs_transformers.json", "workloads[].ours_packed_over, workloads[].ideal_gain_*")
def _vs_transformers(d: dict) -> dict:
    out = {}
    for w in d["workloads"]:
        for name, q in w["ours_packed_over"].items():
            out[f"{w['workload']} ours packed / {name}"] = q["median"]
            out[f"{w['workload']} ours packed / {name} by CPU time"] = w["ours_packed_over_cpu_time"][name]["median"]
        out[f"{w['workload']} ideal gain vs padded random"] = w["ideal_gain_random"]
        out[f"{w['workload']} of ideal vs hf padded"] = w["of_ideal_vs_hf_padded"]
    return out


@figures("default_run_seeds", "default_run_seeds.json", "rows[].final, rows[].evals, rows[].train_s")
def _default_run_seeds(d: dict) -> dict:
    out = {}
    for r in d["rows"]:
        run = f"seed {r['seed']} {r['launcher']}"
        out[f"{run} final colour acc"], out[f"{run} train_s"] = r["final"], r["train_s"]
    return out


@figures("bench_linear_attn", "bench_linear_attn.json", "rows[].b_over_a_fwd_bwd")
def _linear_attn(d: dict) -> dict:
    return {f"{r['case']}: {r['b']} / {r['a']} fwd+bwd": r["b_over_a_fwd_bwd"] for r in d["rows"]}


@figures("packing", "packing.json", "results[].packing_efficiency, results[].packs_per_s")
def _packing(d: dict) -> dict:
    out = {}
    for r in d["results"]:
        name = f"{r['distribution']} {r['packing']}" + (" capped" if r.get("max_image_patches_per_pack") else "")
        out[f"{name} efficiency"], out[f"{name} packs_per_s"] = r["packing_efficiency"], r["packs_per_s"]
    return out


@figures("render", "render.json", "rows[].samples_per_s, rows[].ours_over_this")
def _render(d: dict) -> dict:
    out = {}
    for r in d["rows"]:
        out[f"{r['scenario']} {r['contender']} samples_per_s"] = r["samples_per_s"]
        out[f"{r['scenario']} ours / {r['contender']}"] = r["ours_over_this"]
    return out


@figures("bench_loss_memory", "bench_loss_memory.json", "rows[].extra_peak_mb, rows[].ratio_to_full")
def _loss_memory(d: dict) -> dict:
    out = {}
    for r in d["rows"]:
        name = r["variant"] + (f" {r['chunk_size']}" if r["chunk_size"] else "")
        out[f"{name} extra_peak_mb"], out[f"{name} ratio_to_full"] = r["extra_peak_mb"], r["ratio_to_full"]
    return out


@figures("data", "data.json", "render_pack[].vs_1_worker, gpu_demand, default_run[].data_wait_share")
def _data(d: dict) -> dict:
    out = {f"{r['workers']} workers vs 1": r["vs_1_worker"] for r in d["render_pack"]}
    out |= {f"{r['workers']} workers real_tok_s": r["tokens_per_s"] for r in d["render_pack"]}
    out["H200 tokens_per_s at 40% MFU"] = d["gpu_demand"]["gpu_tokens_per_s"]
    out["workers needed per H200"] = d["gpu_demand"]["workers_needed"]
    out |= {
        f"default run, {r['workers_setting']} workers, data_wait_share": r["data_wait_share"] for r in d["default_run"]
    }
    return out


@figures("lora", "lora.json", "ratios[] (LoRA / full), analytic[]")
def _lora(d: dict) -> dict:
    out = {}
    for r in d["ratios"]:
        out |= {
            f"{r['model']} lora/full {k}": r[k] for k in ("trainable", "optimizer_state", "peak_memory", "step_time")
        }
    for a in d["analytic"]:
        out |= {f"{a['model']} {k}": a[k] for k in ("full_static_gib", "lora_bf16_static_gib")}
    return out


@figures("moe", "moe.json", "cases[].ratio_vs_hf_grouped_mm, cases[].ours_grouped_vs_ours_sorted")
def _moe(d: dict) -> dict:
    out = {}
    for c in d["cases"]:
        out |= {f"{c['case']} {n} / hf grouped_mm": v for n, v in c["ratio_vs_hf_grouped_mm"].items()}
        out[f"{c['case']} ours grouped_mm / ours sorted"] = c["ours_grouped_vs_ours_sorted"]
    return out


@figures("cp", "cp.json", "ratios (cp2 / cp1), analytic[].break_even_gb_s")
def _cp(d: dict) -> dict:
    out = {f"cp2/cp1 {k}": d["ratios"][k] for k in ("step_time", "cpu_time", "saved_activations", "peak_memory")}
    out |= {f"{a['model']} {a['layer']} cp{a['cp']} break_even_gb_s": a["break_even_gb_s"] for a in d["analytic"]}
    return out


@figures("bench_ep", "bench_ep.json", "analytic[].fsdp_over_ep, counted[].counted_over_formula, ratios.<case>")
def _ep(d: dict) -> dict:
    out = {f"35B-A3B {a['layer']} T {a['tokens']} FSDP2 / EP bytes": a["fsdp_over_ep"] for a in d["analytic"]}
    out |= {f"35B-A3B {a['layer']} T {a['tokens']} no AC": a["fsdp_over_ep_no_ac"] for a in d["analytic"]}
    out["35B-A3B break-even tokens per rank"] = d["analytic"][0]["break_even_tokens"]
    out |= {f"counted / formula ep{c['ep']} {c['collective']}": c["counted_over_formula"] for c in d["counted"]}
    out |= {f"{case} ep2/ep1 step_time": r["step_time_s"]["median"] for case, r in d["ratios"].items()}
    return out


@figures("load", "load.json", "rows[].{load,train,save,resume}.peak_over_s (worst rank)")
def _load(d: dict) -> dict:
    out = {}
    for r in d["rows"]:
        for phase in ("load", "train", "save", "resume"):
            out[f"{r['kind']} {r['ranks']} ranks {phase} peak / S"] = max(r[phase]["peak_over_s"])
    return out


@figures("packing_check_calibration", "packing_check_calibration.json", "<dtype>.<case>.{logits,grad} (max over seeds)")
def _calibration(d: dict) -> dict:
    out = {"bound": d["bound"]}
    for dtype in ("bf16", "fp32"):
        for case, r in d.get(dtype, {}).items():
            out[f"{dtype} {case} max ratio"] = max(max(r["logits"]), max(r["grad"]))
    return out


@figures("gpu_check", "gpu_check/gpu_check.json", "verdicts, bench.rows[].real_tok_s / mfu")
def _gpu_check(d: dict) -> dict:
    out = {f"{k} ok": v for k, v in d["verdicts"].items()}
    for r in d.get("bench", {}).get("rows", []):
        name = f"{r['backend']} {r.get('model', '0.8B')} {r.get('tuning', 'full')} {r['mode']}"
        out[f"{name} real_tok_s"], out[f"{name} mfu"] = r["real_tok_s"], r.get("mfu")
    return out


def summarize(results: Path = harness.RESULTS_DIR) -> dict:
    """Every registered benchmark's figures from ``results``; the ones whose JSON is absent under ``missing``."""
    summary: dict = {"generated": datetime.now(UTC).isoformat(timespec="seconds"), "benchmarks": {}, "missing": []}
    for name, (file, key, extract) in EXTRACTORS.items():
        path = results / file
        if not path.is_file():
            summary["missing"].append(file)
            continue
        data = json.loads(path.read_text())
        measured = data.get("machine", {}).get("date")  # written by harness.write_results; older files have none
        entry = {"file": f"bench/results/{file}", "key": key, "measured": measured, "figures": extract(data)}
        summary["benchmarks"][name] = entry
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=harness.RESULTS_DIR, help="the folder of the benchmarks' JSON")
    ap.add_argument("--out", type=Path, help="where to write (default bench/results/summary.json)")
    args = ap.parse_args()
    summary = summarize(args.results)
    count = sum(len(b["figures"]) for b in summary["benchmarks"].values())
    print(
        f"{count} figures from {len(summary['benchmarks'])} benchmarks; missing: {', '.join(summary['missing']) or '-'}"
    )
    harness.write_results("summary", summary, path=args.out)


if __name__ == "__main__":
    main()
