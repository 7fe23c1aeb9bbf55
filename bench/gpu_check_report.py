"""The GPU check's table (printed at the end and saved as ``summary.txt``): one line per part with its verdict, the
trainer's figures, then ``gpu_bench.py``'s throughput rows."""

from __future__ import annotations


def _fmt(x: float | None, spec: str = ".3g", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _train_line(run: dict) -> str:
    if not run.get("losses"):
        return run.get("reason", "no steps logged")
    mem, mfu = run["peak_memory_mb"], run["mfu_median"]
    line = (
        f"steps {run['first_step']}-{run['last_step']}: loss {run['loss_first']:.3f} -> {run['loss_last']:.3f}; "
        f"{_fmt(run['tokens_per_s_median'], '.0f')} tok/s; MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}; "
        f"peak {_fmt(mem and mem / 1024, '.1f')} GiB"
    )
    if run["evals"]:
        last = run["evals"][-1]
        line += f"; eval loss {last['eval_loss']:.3f}, acc {_fmt(last.get('eval_acc_all'), '.2f')}"
    return line


def _train_detail(run: dict) -> str:
    med = run["step_time_median_s"]
    split = "/".join(_fmt(med[k], ".3f") for k in ("data_s", "vision_s", "text_forward_s", "backward_s", "optimizer_s"))
    return f"median step s, data/vision/text fwd/bwd/opt: {split}; {_packing_check_text(run.get('packing_check'))}"


def _packing_check_text(check: dict | None) -> str:
    """The trainer's self-check report (``vlm_sft.checks.packing_check``), read defensively: its fields may grow."""
    if not check:
        return "no packing_check.json"
    ratios = ", ".join(
        f"{k} {_fmt(check[k].get('ratio'), '.2g')}" for k in ("logits", "grad") if isinstance(check.get(k), dict)
    )
    bound = f"; bound {check['bound']}" if "bound" in check else ""
    return f"packing self-check {'ok' if check.get('ok') else 'FAILED'} (leak/floor ratio {ratios}{bound})"


def _resume_detail(c: dict) -> str:
    data = "identical" if c["data_identical"] else "DIFFER"
    lr = "identical" if c["lr_identical"] else "DIFFERS"
    return (
        f"vs uninterrupted, {c['steps_compared']} steps: max rel loss diff {_fmt(c['max_rel_loss_diff'], '.2e')} "
        f"(bound {c['bound']:.0e}), eval {_fmt(c['max_rel_eval_loss_diff'], '.2e')}; tokens/images {data}, lr {lr}"
    )


def _reload_line(rl: dict) -> str:
    if "tokens" not in rl:
        return rl.get("reason", "no figures: see worker.log")
    w = rl.get("vs_resumed", {})
    return (
        f"Qwen3_5VLM + transformers, {rl['tokens']}-token probe: max |logit diff| "
        f"{_fmt(rl['max_abs_logit_diff'], '.2e')} (rel {_fmt(rl['rel_logit_diff'], '.1e')}); "
        f"weights vs resumed final: max |diff| {_fmt(w.get('max_abs_diff'), '.2e')}"
    )


def _vs_line(v: dict) -> str:
    """Ours packed / transformers padded (random batches) and / length-grouped, per workload (medians)."""
    if not v.get("workloads"):
        return v.get("reason", "no figures: see vs_transformers.log")
    parts = []
    for w in v["workloads"]:
        q = w["ours_packed_over"]
        parts.append(
            f"{w['workload']} x{q['hf padded']['median']:.2f} padded, x{q['hf grouped']['median']:.2f} grouped"
        )
    return "ours packed / transformers: " + "; ".join(parts)


def _part_lines(report: dict) -> list[tuple[str, str, dict, str]]:
    """(name, verdict key, part, result text) per line of the table."""
    p, t, b, v = report["pytest"], report["trainer"], report["bench"], report.get("vs", {})
    m, tr, rs, rl = (t.get(k, {}) for k in ("model", "train", "resume", "reload"))
    pytest_text = (
        f"{p.get('passed', 0)} passed, {p.get('failures', 0)} failed, {p.get('errors', 0)} errors, "
        f"{p.get('skipped', 0)} skipped ({len(p.get('files', []))} files)"
    )
    params = m.get("parameters")
    model_text = (
        f"{m.get('layers')} layers ({m.get('linear_attention_layers')} linear attention), "
        f"{_fmt(params and params / 1e6, '.1f')} M parameters, vision {m.get('vision')}"
    )
    bench_text = b.get("reason") or f"{len(b.get('rows', []))} rows"
    bench_text += "" if b.get("complete", True) else " (stopped early)"
    return [
        ("pytest -m gpu", "pytest", p, pytest_text),
        ("random checkpoint", "model", m, model_text),
        ("train (uninterrupted)", "train", tr, _train_line(tr)),
        ("", "train", {}, _train_detail(tr) if tr.get("losses") else ""),
        ("resume", "resume", rs, _train_line(rs)),
        ("", "resume", {}, _resume_detail(rs["comparison"]) if "comparison" in rs else ""),
        ("reload final/", "reload", rl, _reload_line(rl)),
        ("throughput (gpu_bench)", "bench", b, bench_text),
        ("ours vs transformers", "vs", v, _vs_line(v)),
    ]


def summary_table(report: dict) -> str:
    """The table printed at the end (and saved as summary.txt): one line per part, then the throughput rows."""
    env, ok, b = report["environment"], report["verdicts"], report["bench"]
    v = env.get("versions", {})
    lines = [
        f"GPU check{' (--cpu-smoke)' if report['smoke'] else ''}: {env.get('device', '?')}; torch {v.get('torch')}, "
        f"transformers {v.get('transformers')}, triton {v.get('triton')}, fla {v.get('flash-linear-attention')}, "
        f"flash-attn {v.get('flash-attn')}; kernels {'/'.join(env.get('kernels', {}).values()) or '?'}",
        f"{'part':<22} {'status':<8} {'wall s':>7}  result",
        "-" * 120,
    ]
    for name, key, part, text in _part_lines(report):
        if not name:  # a detail line under its part
            if text:
                lines.append(f"{'':<40}{text}")
            continue
        status = part.get("status", "skipped")
        if not ok[key] and status == "ok":
            status = "FAILED"  # ran to the end, but a figure is outside its bound
        elif ok[key]:
            status = "ok"
        lines.append(f"{name:<22} {status:<8} {part.get('wall_s', 0):>7.1f}  {text}")
    lines.append(f"{'total':<22} {'ok' if all(ok.values()) else 'FAILED':<8} {report['wall_s']:>7.1f}")
    if b.get("rows"):
        from gpu_bench import format_rows  # beside this file; imports torch, so only once the parts are done

        lines += ["", f"gpu_bench.py, {b.get('pack_len')}-token packs:", format_rows(b["rows"])]
    if report.get("vs", {}).get("table"):
        lines += ["", report["vs"]["table"]]
    return "\n".join(lines)
